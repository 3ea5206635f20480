"""The vLLM tier of k8s/ (base/vllm.yaml, the vLLM front in the RayService), checked offline on
the rendered manifests: the front routes to exactly the StatefulSet's pods by their DNS names;
each vLLM server loads vitserve's encoder-cache connector (the class the project defines, by
the module path vLLM imports), on the encoder's own model, with the store as the read-only
Redis reader and its secrets by reference; cpu-dev's vLLM serves a twin of the encoder's demo
model whose vision weights are the demo's (built as its init container builds it). The network
policies around the tier are evaluated in test_security.py, the reader user's rights against a
real Redis in test_redis_acl.py. See k8s/README.md, "vLLM tier"."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.k8s.conftest import TARGETS
from tests.k8s.test_manifests import (
    ENCODER_APP_IMPORT,
    SECRET_KEYS,
    VLLM_FRONT_IMPORT,
    VLLM_STATEFULSET,
    applications,
    arg_value,
    container_environ,
    expand,
    one,
    pod_environ,
    pod_templates,
    serve_config,
    store_urls,
)
from vitserve.client.ec_config import ECSettings
from vitserve.deployments.common.config import VitserveConfig

Render = Callable[[str], list[dict[str, Any]]]

CONNECTOR_CLASS = "VitserveECConnector"
CONNECTOR_MODULE = "vitserve.client.vllm"
#: vLLM's --dtype for vitserve's VITSERVE_DTYPE (the rows' dtype)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CONNECTOR_SECRET = "vitserve-vllm"


def _statefulset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "StatefulSet", VLLM_STATEFULSET)


def _vllm(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """The vLLM container, its environment (the Secrets stood in for) and its command line with
    ``$(VAR)`` references expanded as the kubelet does."""
    (container,) = _statefulset(objects)["spec"]["template"]["spec"]["containers"]
    env = container_environ(objects, container)
    argv = [expand(arg, env) for arg in [*container["command"], *container["args"]]]
    assert not any("$(" in arg for arg in argv), argv  # every reference resolves
    return container, env, argv


def _encoder_config(objects: list[dict[str, Any]]) -> VitserveConfig:
    """The encoder application's effective config on the Ray head (the model it serves)."""
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["head"])
    return VitserveConfig.load(applications(rayservice)[ENCODER_APP_IMPORT]["args"], environ)


def _front_config(objects: list[dict[str, Any]]) -> VitserveConfig:
    """The vLLM front's effective config on the Ray head."""
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["head"])
    return VitserveConfig.load(applications(rayservice)[VLLM_FRONT_IMPORT]["args"], environ)


def _mounted_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) behind the file ``path`` of ``container``: a Secret volume mounted as
    a directory (a subPath mount would never see the Secret's updates)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        if os.path.dirname(path) == mount["mountPath"].rstrip("/"):
            assert "subPath" not in mount, mount
            secret = volumes[mount["name"]]["secret"]
            name = os.path.basename(path)
            keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {name: name}
            return secret["secretName"], keys[name]
    raise AssertionError(f"{path} is on no mounted Secret of {container['name']}")


def _ec_config(argv: list[str]) -> dict[str, Any]:
    raw = arg_value(argv, "--ec-transfer-config")
    assert raw is not None, "vLLM runs without --ec-transfer-config: no connector"
    config = json.loads(raw)
    assert isinstance(config, dict), raw
    return config


@pytest.mark.parametrize("target", TARGETS)
def test_the_front_routes_to_every_vllm_pod_by_its_dns_name(render: Render, target: str) -> None:
    """vllm.urls are the StatefulSet's pods, one each, by their names on its headless Service
    and vLLM's port: as many as its replicas, in order (the front names a server by its index).
    The front reaches the encoder application by name, sends vLLM's API key (the vLLM pods'
    own), and overlaps encode and forward exactly where the encoder has GPUs of its own."""
    from vitserve.deployments.vllm.app import overlaps

    objects = render(target)
    rayservice = one(objects, "RayService")
    apps = applications(rayservice)
    front, encoder_app = apps[VLLM_FRONT_IMPORT], apps[ENCODER_APP_IMPORT]
    statefulset = _statefulset(objects)
    service = one(objects, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"  # one DNS name per pod
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container, env, _ = _vllm(objects)
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    replicas = statefulset["spec"]["replicas"]
    name, domain = statefulset["metadata"]["name"], service["metadata"]["name"]
    expected = [f"http://{name}-{i}.{domain}:{port}" for i in range(replicas)]
    assert replicas >= 1
    for group, template in pod_templates(rayservice).items():
        environ = pod_environ(objects, template)
        cfg = VitserveConfig.load(front["args"], environ=environ)
        assert cfg.vllm.urls == expected, group
        assert cfg.auth.enabled, group
        assert cfg.vllm.encoder_app == encoder_app["name"]
        assert cfg.vllm.api_key is not None
        assert cfg.vllm.api_key.get_secret_value() == env["VLLM_API_KEY"], group
        encoder = VitserveConfig.load(encoder_app["args"], environ=environ).encoder
        assert overlaps(cfg) == bool(encoder.num_gpus), group
    assert SECRET_KEYS[CONNECTOR_SECRET, "api-key"] == env["VLLM_API_KEY"]


@pytest.mark.parametrize("target", TARGETS)
def test_vllm_runs_vitserves_connector_on_the_encoders_model(
    render: Render, target: str, tmp_path: Path
) -> None:
    """Each vLLM server's --ec-transfer-config names the connector class the project defines
    (found by its module path, as vLLM imports it, and read without importing vLLM), as a
    consumer; its settings load with the connector's own strict reader: the store is the Redis
    reader's URL (from the Secret, by the variable's name), the token a file of the Secret
    vitserve-vllm, the service the encoder application through KubeRay's serve Service. vLLM
    serves the encoder's model under the name the encoder gives it, in the encoder's dtype,
    with as many images per prompt as the front lets through."""
    objects = render(target)
    container, env, argv = _vllm(objects)
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    config = _ec_config(argv)
    assert config["ec_connector"] == CONNECTOR_CLASS
    assert config["ec_connector_module_path"] == CONNECTOR_MODULE
    assert config["ec_role"] == "ec_consumer"  # vitserve's encoders produce; vLLM reads
    spec = importlib.util.find_spec(config["ec_connector_module_path"])
    assert spec is not None and spec.origin is not None, config["ec_connector_module_path"]
    module = ast.parse(Path(spec.origin).read_text())
    classes = {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}
    assert config["ec_connector"] in classes, sorted(classes)
    bases = [ast.unparse(b) for b in classes[config["ec_connector"]].bases]
    assert bases == ["ECConnectorBase"]  # vLLM's connector interface

    extra = config["ec_connector_extra_config"]
    assert not {"store", "token"} & set(extra), "secrets by reference only: vLLM logs this"
    statefulset = _statefulset(objects)
    pod_spec = statefulset["spec"]["template"]["spec"]
    secret = _mounted_file(pod_spec, container, extra["token_file"])
    assert secret == (CONNECTOR_SECRET, "connector-token")
    token = tmp_path / "connector-token"
    token.write_text(SECRET_KEYS[secret] + "\n")
    settings = ECSettings.from_extra({**extra, "token_file": str(token)}, environ=env)
    assert settings.token == SECRET_KEYS[secret]
    assert settings.store == store_urls(target)[1]  # the reader: read-only
    assert urlsplit(settings.store).username == "vitserve-reader"
    # no writer's password anywhere in the pod: not in its env, not as a file
    referenced = {
        var["valueFrom"]["secretKeyRef"]["name"]
        for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
        for var in c.get("env", [])
        if "secretKeyRef" in var.get("valueFrom", {})
    } | {v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v}
    assert referenced == {"vitserve-redis-reader", CONNECTOR_SECRET}
    # the service: the encoder application (route /) through KubeRay's serve Service
    rayservice = one(objects, "RayService")
    url = urlsplit(settings.url)
    assert url.hostname == f"{rayservice['metadata']['name']}-serve-svc"
    assert url.port == serve_config(rayservice)["http_options"]["port"]
    assert url.path == "" and applications(rayservice)[ENCODER_APP_IMPORT]["route_prefix"] == "/"

    cfg = _encoder_config(objects)
    model = arg_value(argv, "--model")
    served = arg_value(argv, "--served-model-name") or model
    assert served == cfg.model  # clients name the model as the encoder does
    if target != "cpu-dev":  # cpu-dev: the demo model's twin (the next test)
        assert model == cfg.model
    assert arg_value(argv, "--dtype") == DTYPES[cfg.dtype]
    # what the front lets through, vLLM takes (a chat vLLM refuses would be encoded for naught)
    front = _front_config(objects)
    limits = json.loads(arg_value(argv, "--limit-mm-per-prompt") or "{}")
    assert limits.get("image") == front.limits.max_images_per_request
    assert limits.get("video") == front.limits.max_videos_per_request


@pytest.mark.parametrize("target", TARGETS)
def test_vllm_pods_are_gpu_servers_with_probes_on_health(render: Render, target: str) -> None:
    """One GPU per vLLM server (not in cpu-dev: test_cpu_dev_is_one_cpu_node), vLLM's
    /health as startup, readiness and liveness probe, its port named for the PodMonitor."""
    objects = render(target)
    container, _, _ = _vllm(objects)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert [p["name"] for p in container["ports"]] == ["http"]
    monitor = one(objects, "PodMonitor", "vitserve-vllm")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http"]
    if target == "cpu-dev":
        return
    spec = _statefulset(objects)["spec"]["template"]["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu"}
    assert container["image"].endswith("-gpu")


def test_cpu_dev_vllm_serves_a_twin_of_the_encoders_demo_model(
    render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu-dev's vLLM cannot load ``demo`` (vitserve builds it; its 16-wide language-model
    heads are below vLLM's CPU attention's minimum): its init container builds the demo's
    vLLM twin. Run here as the kubelet would (its command with this venv's python, its env,
    its volumes as folders), the folder vLLM serves has the vision identity of the model the
    encoder builds for ``demo``: the connector's model check passes, and the rows are the
    encoder's."""
    from vitserve.deployments.common.serving import resolve_model
    from vitserve.encoder.loading import vision_identity

    objects = render("cpu-dev")
    spec = _statefulset(objects)["spec"]["template"]["spec"]
    (init,) = [c for c in spec.get("initContainers", []) if c["name"] == "demo-model"]
    container, _, argv = _vllm(objects)

    def local(c: dict[str, Any], path: str) -> Path:
        """``path`` as ``c`` sees it, on a folder per volume under tmp_path."""
        mounts = sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        for mount in mounts:
            root = mount["mountPath"].rstrip("/")
            if path == root or path.startswith(root + "/"):
                folder = tmp_path / mount["name"]
                folder.mkdir(exist_ok=True)
                return Path(str(folder) + path[len(root) :])
        raise AssertionError(f"{path} is on no volume of {c['name']}: a read-only root")

    program, *args = init["command"]
    assert program == "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env |= {k: str(local(init, v)) for k, v in container_environ(objects, init).items()}
    try:
        result = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        served = local(container, arg_value(argv, "--model") or "")
        assert served == Path(env["DEMO_MODEL_DIR"]) and (served / "config.json").is_file()
        # the encoder's demo model, built as the Ray head builds it (same cache: a fresh one)
        cfg = _encoder_config(objects)
        assert cfg.model == "demo"
        monkeypatch.setenv("VITSERVE_CACHE", env["VITSERVE_CACHE"])
        encoders = resolve_model(cfg.model)
        assert Path(encoders).resolve() != served.resolve()  # a twin, not the same folder
        assert vision_identity(str(served)) == vision_identity(encoders)
        # ... and a rerun (a restarted pod) finds it built and links it again
        again = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert again.returncode == 0, again.stderr[-3000:]
    finally:  # two models of ~400 MB each: not left in the temporary folders
        for folder in tmp_path.iterdir():
            shutil.rmtree(folder, ignore_errors=True)


def test_cpu_dev_connector_token_is_a_tenants_with_a_redis_reader(render: Render) -> None:
    """cpu-dev generates the Secrets: the connector's token is the tenant ``vllm``'s in the
    tokens file (the service answers its /healthz with the model only to a tenant), and that
    tenant has its Redis reader's password (Redis' init container refuses a tenant without)."""
    import base64

    from vitserve.deployments.common.auth import parse_tokens

    objects = render("cpu-dev")
    secrets = {
        o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
        for o in objects
        if o["kind"] == "Secret"
    }
    lines = parse_tokens(secrets["vitserve-tokens"]["tokens"], "tokens")
    tenants = {token: tenant for tenant, token in lines}
    assert tenants.get(secrets[CONNECTOR_SECRET]["connector-token"]) == "vllm"
    assert set(tenants.values()) <= set(secrets["vitserve-redis-tenant-readers"])
    assert secrets[CONNECTOR_SECRET]["api-key"]
