"""The Kubernetes manifests (k8s/), checked offline: core objects against Kubernetes' own
schemas (kubernetes-validate, strict), the RayService against KubeRay's CRD schema made strict,
and the Serve config inside it against vitserve's strict config; a misspelled field fails each
check. See k8s/README.md."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s.conftest import TARGETS
from vitserve.deployments.common.config import VitserveConfig
from vitserve.errors import ConfigError

Render = Callable[[str], list[dict[str, Any]]]

K8S_VERSION = "1.32.0"
# KubeRay's CRDs are shared data, never copied in: $VITSERVE_TEST_KUBERAY_CRDS, else beside the
# checkout (../shared/kuberay/crds), else the workspace's (/work/shared/kuberay/crds).
_CRD_ENV = "VITSERVE_TEST_KUBERAY_CRDS"
_CRD_PLACES = [Path(os.environ[_CRD_ENV])] if _CRD_ENV in os.environ else []
_CRD_PLACES += [
    Path(__file__).resolve().parents[3] / "shared" / "kuberay" / "crds",
    Path("/work/shared/kuberay/crds"),
]
CRDS = next((p for p in _CRD_PLACES if p.is_dir()), _CRD_PLACES[0])
CUSTOM_KINDS = {"RayService", "PodMonitor"}  # no schema in kubernetes-validate's bundle
ENCODER_APP_IMPORT = "vitserve.deployments.encoder.app:build_app"
PREFILL_APP_IMPORT = "vitserve.deployments.prefill.app:build_app"
VLLM_FRONT_IMPORT = "vitserve.deployments.vllm.app:build_app"
WORK_POLICY_IMPORT = "vitserve.deployments.encoder.autoscaling:work_policy"
# Stand-ins for the Redis Secrets' passwords (Secret name -> value of its key `password`).
SECRETS = {"vitserve-redis-writer": "wr1ter-s3cr3t", "vitserve-redis-reader": "r3ader-s3cr3t"}
#: Stand-ins for every Secret key a container's env names: (Secret name, key) -> value.
SECRET_KEYS = {(name, "password"): value for name, value in SECRETS.items()} | {
    ("vitserve-vllm", "api-key"): "vllm-api-k3y-0123456789abcdef",
    ("vitserve-vllm", "connector-token"): "vllm-c0nnector-token-0123456789",
}
#: the vLLM tier (k8s/base/vllm.yaml): its StatefulSet and its container
VLLM_STATEFULSET, VLLM_CONTAINER = "vitserve-vllm", "vllm"
WRITER_URL = f"redis://vitserve-writer:{SECRETS['vitserve-redis-writer']}@vitserve-redis:6379/0"
READER_URL = f"redis://vitserve-reader:{SECRETS['vitserve-redis-reader']}@vitserve-redis:6379/0"
#: the targets whose store is a Redis Cluster (production: k8s/overlays/gpu-prod/redis.yaml)
CLUSTER_TARGETS = {"gpu-prod"}


def store_urls(target: str) -> tuple[str, str]:
    """The writer's and the reader's Redis URL in ``target``'s Ray pods."""
    if target not in CLUSTER_TARGETS:
        return WRITER_URL, READER_URL
    return tuple(  # type: ignore[return-value]
        url.replace("redis://", "redis+cluster://").removesuffix("/0")
        for url in (WRITER_URL, READER_URL)
    )


# --- helpers ----------------------------------------------------------------------------------


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name (``head`` for the head group) -> the pod template of that Ray group."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster.get("workerGroupSpecs", []):
        templates[group["groupName"]] = group["template"]
    return templates


def container_environ(
    objects: list[dict[str, Any]], container: dict[str, Any], pod_name: str = "pod-0"
) -> dict[str, str]:
    """The environment a container gets: its ConfigMaps (envFrom), then its own env with
    ``$(VAR)`` references expanded as the kubelet does (SECRET_KEYS stand in for the Secrets,
    ``pod_name`` for the pod's ``metadata.name``; a ConfigMap key is the rendered one's)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(one(objects, "ConfigMap", name)["data"])
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", var
            env[var["name"]] = pod_name
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = one(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif "valueFrom" in var:
            ref = source["secretKeyRef"]
            assert (ref["name"], ref["key"]) in SECRET_KEYS, ref
            env[var["name"]] = SECRET_KEYS[ref["name"], ref["key"]]
        else:
            env[var["name"]] = expand(var["value"], env)
    return env


def expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` references in ``value`` replaced as the kubelet does (unknown ones kept)."""
    for name, known in env.items():
        value = value.replace(f"$({name})", known)
    return value


def pod_environ(objects: list[dict[str, Any]], template: dict[str, Any]) -> dict[str, str]:
    """The ``VITSERVE_*`` environment a Ray pod's container gets (see container_environ)."""
    (container,) = template["spec"]["containers"]
    env = container_environ(objects, container)
    return {k: v for k, v in env.items() if k.startswith("VITSERVE_")}


def redis_directives(args: list[str]) -> list[list[str]]:
    """redis-server's command line as config directives: ``[--name, value, ...]`` each (a
    directive's values run up to the next ``--name``)."""
    directives: list[list[str]] = []
    for arg in args:
        if arg.startswith("--"):
            directives.append([arg])
        else:
            assert directives, f"a value before any --directive: {arg!r}"
            directives[-1].append(arg)
    return directives


def redis_tier(url: str) -> str:
    """The Redis URL of a store URL: itself, or a ``tiered://`` URL's shared tier (``l2``)."""
    parts = urlsplit(url)
    if parts.scheme == "tiered":
        return dict(parse_qsl(parts.query))["l2"]
    return url


_SIZE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def size_bytes(text: str) -> int:
    """A Kubernetes quantity (``8Gi``, ``500M``) or a Redis size (``3gb``, ``512mb``) in bytes."""
    raw = str(text).strip().lower().removesuffix("b")
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if unit in ("k", "m", "g") and str(text).lower().endswith("b"):  # Redis: 1gb = 1024 MB
        return int(float(digits) * 2 ** {"k": 10, "m": 20, "g": 30}[unit])
    return int(float(digits) * _SIZE[unit])


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    assert isinstance(rayservice["spec"]["serveConfigV2"], str)
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def applications(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """import_path -> Serve application (one each of the encoder and prefill apps and the
    vLLM front)."""
    apps = serve_config(rayservice)["applications"]
    by_import = {app["import_path"]: app for app in apps}
    assert len(by_import) == len(apps)
    assert sorted(by_import) == sorted([ENCODER_APP_IMPORT, PREFILL_APP_IMPORT, VLLM_FRONT_IMPORT])
    return by_import


def vllm_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The vLLM server's container of the StatefulSet vitserve-vllm."""
    statefulset = one(objects, "StatefulSet", VLLM_STATEFULSET)
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["name"] == VLLM_CONTAINER
    return container


def arg_value(args: list[str], flag: str) -> str | None:
    """The value after ``flag`` on a command line (None: the flag is not there)."""
    found = [i for i, arg in enumerate(args) if arg == flag]
    assert len(found) <= 1, f"{flag} given {len(found)} times"
    return args[found[0] + 1] if found else None


def load_attribute(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def validate_core(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and does not preserve unknown fields (kubeconform's strict mode): a CRD's
    schema prunes unknown fields on a cluster instead of refusing them."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict_schema(value) for key, value in schema.items()}
    if (
        "properties" in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def rayservice_validator() -> jsonschema.protocols.Validator:
    crd_file = CRDS / "ray.io_rayservices.yaml"
    if not crd_file.is_file():
        pytest.skip(
            f"KubeRay CRDs not found at {', '.join(map(str, _CRD_PLACES))} (shared data; "
            "set VITSERVE_TEST_KUBERAY_CRDS)"
        )
    crd = yaml.safe_load(crd_file.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator: jsonschema.protocols.Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


# --- 1. core objects --------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_core_objects_validate_strictly(render: Render, target: str) -> None:
    objects = render(target)
    kinds = {o["kind"] for o in objects}
    assert {
        "ConfigMap",
        "StatefulSet",
        "Service",
        "RayService",
        "PodMonitor",
        "NetworkPolicy",
        "PodDisruptionBudget",
    } <= kinds
    for doc in objects:
        if doc["kind"] not in CUSTOM_KINDS:
            validate_core(doc)


def test_misspelled_core_field_fails(render: Render) -> None:
    redis = one(render("base"), "StatefulSet", "vitserve-redis")
    validate_core(redis)
    redis["spec"]["replica"] = redis["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        validate_core(redis)


# --- 2. the RayService against KubeRay's CRD -------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_rayservice_validates_against_crd(
    render: Render, target: str, rayservice_validator: jsonschema.protocols.Validator
) -> None:
    rayservice = one(render(target), "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert schema_errors(rayservice_validator, rayservice) == []


@pytest.mark.parametrize(
    ("path", "wrong"),
    [
        (("spec", "rayClusterConfig", "enableInTreeAutoscaling"), "enableInTreeAutoscalling"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 1, "maxReplicas"), "maxReplica"),
        (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "volumes"), "volume"),
    ],
)
def test_misspelled_rayservice_field_fails(
    render: Render,
    rayservice_validator: jsonschema.protocols.Validator,
    path: tuple[Any, ...],
    wrong: str,
) -> None:
    rayservice = one(render("base"), "RayService")
    node = rayservice
    for part in path[:-1]:
        node = node[part]
    node[wrong] = node.pop(path[-1])
    errors = schema_errors(rayservice_validator, rayservice)
    assert any(wrong in e for e in errors), errors


# --- 3. the Serve config inside the RayService ------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_serve_applications_load_with_the_strict_config(render: Render, target: str) -> None:
    objects = render(target)
    rayservice = one(objects, "RayService")
    apps = applications(rayservice)
    encoder_app, prefill_app = apps[ENCODER_APP_IMPORT], apps[PREFILL_APP_IMPORT]
    front_app = apps[VLLM_FRONT_IMPORT]
    assert encoder_app["route_prefix"] == "/"
    assert prefill_app["route_prefix"] == "/prefill"
    assert front_app["route_prefix"] == "/vllm"
    writer, reader = store_urls(target)
    # Every Ray pod may build or host any application: each must load with its environment.
    for group, template in pod_templates(rayservice).items():
        environ = pod_environ(objects, template)
        for app in (encoder_app, prefill_app, front_app):
            # The store URLs and vLLM's API key carry secrets: from the Secrets, never in the
            # CR's args. The encoder side writes as the writer, the prefill and the vLLM front
            # read as the reader (directly, or as the shared tier of a tiered store:
            # test_gpu_prod_stores_are_tiered).
            assert "store" not in app["args"], app["name"]
            for section in ("prefill", "vllm"):
                assert not {"store", "api_key"} & set(app["args"].get(section, {})), app["name"]
            cfg = VitserveConfig.load(app["args"], environ=environ)
            stores = (redis_tier(cfg.store), redis_tier(cfg.prefill.store))
            assert stores == (writer, reader), group
            assert redis_tier(cfg.vllm.store) == reader, group
        cfg = VitserveConfig.load(prefill_app["args"], environ=environ)
        assert cfg.prefill.encoder_app == encoder_app["name"]
        assert cfg.prefill.chunk_size == 512
        cfg = VitserveConfig.load(front_app["args"], environ=environ)
        assert cfg.vllm.encoder_app == encoder_app["name"]
        assert cfg.vllm.route_prefix == front_app["route_prefix"]
        assert cfg.vllm.api_key is not None  # vLLM's --api-key (test_vllm.py)


@pytest.mark.parametrize("target", TARGETS)
def test_import_paths_resolve(render: Render, target: str) -> None:
    for import_path in applications(one(render(target), "RayService")):
        assert callable(load_attribute(import_path)), import_path


@pytest.mark.parametrize("target", TARGETS)
def test_encoder_autoscales_on_work(render: Render, target: str) -> None:
    encoder_args = applications(one(render(target), "RayService"))[ENCODER_APP_IMPORT]["args"]
    autoscaling = encoder_args["encoder"]["autoscaling"]
    assert autoscaling["policy"] == "work"
    assert autoscaling["min_replicas"] <= autoscaling["max_replicas"]
    # The policy the `work` setting names (vitserve.deployments.encoder.autoscaling).
    assert callable(load_attribute(WORK_POLICY_IMPORT))


def test_misspelled_vitserve_arg_fails(render: Render) -> None:
    args = applications(one(render("base"), "RayService"))[ENCODER_APP_IMPORT]["args"]
    autoscaling = args["encoder"]["autoscaling"]
    autoscaling["max_replica"] = autoscaling.pop("max_replicas")
    with pytest.raises(ConfigError, match="max_replica"):
        VitserveConfig.load(args, environ={})


def test_unknown_configmap_variable_fails(render: Render) -> None:
    objects = render("base")
    environ = pod_environ(objects, pod_templates(one(objects, "RayService"))["head"])
    environ["VITSERVE_LIMITS__MAX_IMAGE"] = "16"
    with pytest.raises(ConfigError, match="max_image"):
        VitserveConfig.load({}, environ=environ)


# --- the cluster's shape ----------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_ray_pod_has_shm_probes_resources_and_env(render: Render, target: str) -> None:
    rayservice = one(render(target), "RayService")
    for group, template in pod_templates(rayservice).items():
        spec = template["spec"]
        (container,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", group
        assert container["readinessProbe"] and container["livenessProbe"], group
        assert {"requests", "limits"} <= set(container["resources"]), group
        assert "vitserve" in container["image"], group
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", group
        assert annotations["prometheus.io/port"] == "8080", group


@pytest.mark.parametrize("target", ["base", "gpu-prod"])
def test_gpu_cluster_shape(render: Render, target: str) -> None:
    rayservice = one(render(target), "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert list(groups) == ["cpu", "gpu"]  # the overlays patch them by index
    gpu = groups["gpu"]
    (container,) = gpu["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {t["key"] for t in gpu["template"]["spec"]["tolerations"]} == {"nvidia.com/gpu"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}
    # Room for every GPU replica Serve may ask for (one GPU per pod).
    apps = applications(rayservice)
    encoder = apps[ENCODER_APP_IMPORT]["args"]["encoder"]
    prefill = apps[PREFILL_APP_IMPORT]["args"]["prefill"]
    assert encoder["num_gpus"] == 1
    needed = encoder["autoscaling"]["max_replicas"] + prefill["num_replicas"]
    assert gpu["minReplicas"] <= gpu["maxReplicas"] == needed
    assert container["image"].endswith("-gpu")


def test_cpu_dev_is_one_cpu_node(render: Render) -> None:
    objects = render("cpu-dev")
    rayservice = one(objects, "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert "workerGroupSpecs" not in cluster
    (container,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["image"].endswith("-cpu")
    environ = pod_environ(objects, cluster["headGroupSpec"]["template"])
    for app in applications(rayservice).values():
        cfg = VitserveConfig.load(app["args"], environ=environ)
        assert cfg.encoder.num_gpus == 0 and cfg.prefill.num_gpus == 0
        assert cfg.vllm.num_gpus == 0
        assert cfg.model == "demo"
    # ... and the vLLM tier on CPU too: vLLM's CPU build, no GPU asked for or tolerated
    vllm = vllm_container(objects)
    assert "nvidia.com/gpu" not in vllm["resources"]["limits"]
    assert "nvidia.com/gpu" not in vllm["resources"]["requests"]
    assert vllm["image"].endswith("-cpu")
    statefulset = one(objects, "StatefulSet", VLLM_STATEFULSET)
    assert not statefulset["spec"]["template"]["spec"].get("tolerations")


@pytest.mark.parametrize("target", TARGETS)
def test_redis_is_a_bounded_cache_that_survives_a_restart(render: Render, target: str) -> None:
    objects = render(target)
    redis = one(objects, "StatefulSet", "vitserve-redis")
    spec = redis["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    flags = {name: values for name, *values in redis_directives(container["args"])}
    if target in CLUSTER_TARGETS:  # three primaries and a replica of each, in cluster mode
        assert redis["spec"]["replicas"] == 6
        assert flags["--cluster-enabled"] == ["yes"]
        (nodes_conf,) = flags["--cluster-config-file"]  # on the volume: a pod rejoins as itself
        assert nodes_conf.startswith(flags["--dir"][0] + "/")
        headless = one(objects, "Service", "vitserve-redis-nodes")
        assert headless["spec"]["clusterIP"] == "None"
        assert flags["--cluster-announce-hostname"] == ["$(POD_NAME).vitserve-redis-nodes"]
        assert flags["--cluster-preferred-endpoint-type"] == ["hostname"]
        assert {p["port"] for p in headless["spec"]["ports"]} == {6379, 16379}
        one(objects, "Job", "vitserve-redis-cluster-init")
    else:
        assert redis["spec"]["replicas"] == 1  # one cache: two would split the keys
    assert "--requirepass" not in flags and "--user" not in flags  # the aclfile's users
    assert flags["--maxmemory-policy"] == ["allkeys-lru"]
    # Persistence: the append-only file, fsync'd every second, on the claimed volume.
    assert flags["--appendonly"] == ["yes"] and flags["--appendfsync"] == ["everysec"]
    (data_dir,) = flags["--dir"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data_dir]
    (claim,) = [
        c for c in redis["spec"]["volumeClaimTemplates"] if c["metadata"]["name"] == mount["name"]
    ]
    assert mount["name"] not in {v["name"] for v in spec.get("volumes", [])}  # the claim, no other
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    env = {e["name"]: e for e in container["env"]}
    maxmemory = size_bytes(env["REDIS_MAXMEMORY"]["value"])
    # room for the file and its rewrite (each at most the dataset) ...
    assert size_bytes(claim["spec"]["resources"]["requests"]["storage"]) >= 2 * maxmemory
    # ... and memory above maxmemory for Redis' overhead and the rewrite's fork
    assert size_bytes(container["resources"]["limits"]["memory"]) > maxmemory
    # Access: the aclfile the init container writes into a volume Redis mounts read-only
    (aclfile,) = flags["--aclfile"]
    (acl_mount,) = [
        m for m in container["volumeMounts"] if aclfile.startswith(m["mountPath"] + "/")
    ]
    assert acl_mount.get("readOnly") is True
    (init,) = spec["initContainers"]
    assert init["command"][:2] == ["vitserve", "redis-acl"]
    out = init["command"][init["command"].index("--out") + 1]
    assert [m["name"] for m in init["volumeMounts"] if out.startswith(m["mountPath"] + "/")] == [
        acl_mount["name"]
    ]
    # the reader's password reaches the probe only; the other passwords reach no env
    secrets = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert secrets == {"vitserve-redis-reader"}


@pytest.mark.parametrize("target", ["gpu-prod"])
def test_gpu_prod_stores_are_tiered(
    render: Render, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu-prod's stores are tiered: this node's shared memory (node://) in front of Redis, so
    a Redis outage leaves the node tier answering (vitserve.cache.tiered). Parsed by the
    store's own URL parser (open_connection), with the node tier's connection stubbed: it
    would need Ray; the Redis one connects only when used."""
    from vitserve.cache import node
    from vitserve.cache.redis_cluster import RedisClusterConnection
    from vitserve.cache.tiered import TieredConnection
    from vitserve.cache.urls import open_connection

    class NodeTier:
        def __init__(self, **options: Any) -> None:
            self.options = options

        def close(self) -> None:
            pass

    monkeypatch.setattr(node, "NodeConnection", NodeTier)
    objects = render(target)
    rayservice = one(objects, "RayService")
    for group, template in pod_templates(rayservice).items():
        environ = pod_environ(objects, template)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (shm,) = [v for v in volumes.values() if v.get("emptyDir", {}).get("medium") == "Memory"]
        for app in applications(rayservice).values():
            cfg = VitserveConfig.load(app["args"], environ=environ)
            for url, user in (
                (cfg.store, "vitserve-writer"),
                (cfg.prefill.store, "vitserve-reader"),
                (cfg.vllm.store, "vitserve-reader"),
            ):
                connection, _ = open_connection(url)
                assert isinstance(connection, TieredConnection), (group, user)
                assert isinstance(connection.local, NodeTier), (group, user)
                assert isinstance(connection.shared, RedisClusterConnection), (group, user)
                assert connection.shared.name == f"redis+cluster {user}@vitserve-redis:6379"
                # the node tier lives in the pod's object store (/dev/shm): well inside it
                budget = connection.local.options["max_bytes"]
                assert 0 < budget <= size_bytes(shm["emptyDir"]["sizeLimit"]) // 2, group
                connection.close()
