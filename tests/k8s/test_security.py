"""Secure by default (issue 28), checked on the rendered manifests of base and both overlays:
auth on in every Serve application's effective config (tokens from a mounted Secret), network
policies that deny by default (evaluated, not string-matched: "may this peer open port P on
that pod?"), a hardened securityContext and bounded ephemeral storage on every container,
disruption budgets that select exactly the pods they protect, and Prometheus sending the scrape
token to vitserve's /metrics routes.

The pods are modelled as KubeRay builds them from the RayService (its labels, the autoscaler
container it adds to the head, the init container it adds to workers, the volumes it adds when
missing: ray-operator/controllers/ray/common/pod.go), so a check sees what runs, not only what
the templates say.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.conftest import K8S, TARGETS
from tests.k8s.test_manifests import (
    CLUSTER_TARGETS,
    VLLM_STATEFULSET,
    applications,
    one,
    pod_environ,
    pod_templates,
    redis_directives,
    size_bytes,
)
from vitserve.deployments.common.config import MIN_TOKEN_CHARS, VitserveConfig

Render = Callable[[str], list[dict[str, Any]]]

TOKENS_SECRET = "vitserve-tokens"
TOKENS_FILE = "/etc/vitserve/auth/tokens"
SCRAPE_TOKEN_FILE = "/etc/vitserve/auth/scrape-token"
RAY_UID, REDIS_UID = 1000, 999


# --- pods as they run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    """A pod (ours, as built from the manifests, or a stand-in elsewhere in the cluster)."""

    name: str
    namespace: str
    labels: dict[str, str] = field(hash=False)
    spec: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def ray(self) -> bool:
        return self.name in ("head", "cpu", "gpu")


@dataclass(frozen=True)
class Host:
    """An address outside the cluster's pods (the internet, the API server's endpoint)."""

    name: str
    ip: str


Endpoint = Pod | Host


def kuberay_labels(group: str, template: dict[str, Any]) -> dict[str, str]:
    """The labels KubeRay gives a Ray pod (labelPod): its own, then the template's, except
    that ray.io/node-type, ray.io/group and ray.io/cluster stay KubeRay's."""
    node_type = "head" if group == "head" else "worker"
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": "vitserve-raycluster-abcde",
        "ray.io/node-type": node_type,
        "ray.io/group": "headgroup" if group == "head" else group,
        "ray.io/identifier": f"vitserve-raycluster-abcde-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    fixed = {"ray.io/node-type", "ray.io/group", "ray.io/cluster"}
    labels |= {k: v for k, v in template["metadata"].get("labels", {}).items() if k not in fixed}
    return labels


def _add_empty_dir(
    spec: dict[str, Any], container: dict[str, Any], name: str, path: str, memory: bool
) -> None:
    """KubeRay's addEmptyDir: nothing if the container mounts ``path`` already; else the
    volume ``name`` (an emptyDir with no size limit on disk, the container's memory as the
    limit in memory) unless the pod has one of that name, mounted at ``path``."""
    if any(m["mountPath"] == path for m in container.get("volumeMounts", [])):
        return
    if not any(v["name"] == name for v in spec.setdefault("volumes", [])):
        empty: dict[str, Any] = {}
        if memory:
            empty = {"medium": "Memory", "sizeLimit": container["resources"]["limits"]["memory"]}
        spec["volumes"].append({"name": name, "emptyDir": empty})
    container.setdefault("volumeMounts", []).append({"name": name, "mountPath": path})


def kuberay_pod_spec(rayservice: dict[str, Any], group: str) -> dict[str, Any]:
    """The pod spec KubeRay builds for ``group`` (DefaultHeadPodTemplate /
    DefaultWorkerPodTemplate, BuildPod)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    spec = copy.deepcopy(pod_templates(rayservice)[group]["spec"])
    ray = spec["containers"][0]
    autoscaling = group == "head" and cluster.get("enableInTreeAutoscaling", False)
    if autoscaling:
        options = cluster.get("autoscalerOptions", {})
        autoscaler: dict[str, Any] = {
            "name": "autoscaler",
            "image": options.get("image", ray["image"]),
            "resources": options.get(
                "resources",
                {
                    "requests": {"cpu": "500m", "memory": "512Mi"},
                    "limits": {"cpu": "500m", "memory": "512Mi"},
                },
            ),
            "volumeMounts": copy.deepcopy(options.get("volumeMounts", [])),
        }
        if "securityContext" in options:
            autoscaler["securityContext"] = copy.deepcopy(options["securityContext"])
        spec["containers"].append(autoscaler)
    if group != "head":  # wait-gcs-ready: the Ray container's securityContext and mounts
        init = {
            "name": "wait-gcs-ready",
            "image": ray["image"],
            "kuberay_injected": True,  # resources fixed by KubeRay (200m, 256Mi)
            "resources": {
                "requests": {"cpu": "200m", "memory": "256Mi"},
                "limits": {"cpu": "200m", "memory": "256Mi"},
            },
            "volumeMounts": copy.deepcopy(ray.get("volumeMounts", [])),
        }
        if "securityContext" in ray:
            init["securityContext"] = copy.deepcopy(ray["securityContext"])
        spec.setdefault("initContainers", []).append(init)
    _add_empty_dir(spec, ray, "shared-mem", "/dev/shm", memory=True)
    if autoscaling:
        _add_empty_dir(spec, ray, "ray-logs", "/tmp/ray", memory=False)
        _add_empty_dir(spec, spec["containers"][-1], "ray-logs", "/tmp/ray", memory=False)
    return spec


def app_namespace(objects: list[dict[str, Any]]) -> str:
    """The namespace the target deploys into (base has none: the current one, "app" here)."""
    return one(objects, "RayService")["metadata"].get("namespace", "app")


def our_pods(objects: list[dict[str, Any]]) -> dict[str, Pod]:
    """name (``head``, the worker groups, ``redis``, ``vllm``, and a Redis Cluster's bootstrap
    Job's ``redis-init``) -> our pods as they run."""
    ns = app_namespace(objects)
    rayservice = one(objects, "RayService")
    pods = {
        group: Pod(group, ns, kuberay_labels(group, template), kuberay_pod_spec(rayservice, group))
        for group, template in pod_templates(rayservice).items()
    }
    # a StatefulSet (a Deployment before issue 28: the checks then fail on what they check)
    (redis,) = [
        o
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["name"] == "vitserve-redis"
    ]
    template = redis["spec"]["template"]
    pods["redis"] = Pod("redis", ns, dict(template["metadata"]["labels"]), template["spec"])
    template = one(objects, "StatefulSet", VLLM_STATEFULSET)["spec"]["template"]
    pods["vllm"] = Pod("vllm", ns, dict(template["metadata"]["labels"]), template["spec"])
    for job in (o for o in objects if o["kind"] == "Job"):
        template = job["spec"]["template"]
        pods["redis-init"] = Pod(
            "redis-init", ns, dict(template["metadata"]["labels"]), template["spec"]
        )
    return pods


# Namespaces elsewhere, with the labels the manifests' selectors expect (k8s/README.md), and
# the pods there the policies must tell apart.
NAMESPACE_LABELS = {
    "gateway-system": {"vitserve.io/gateway": "true"},
    "monitoring": {"vitserve.io/monitoring": "true"},
}
GATEWAY = Pod("gateway", "gateway-system", {"app": "envoy"})
MONITORING = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"})
OPERATOR = Pod("kuberay-operator", "kuberay-system", {"app.kubernetes.io/name": "kuberay"})
DNS = Pod("coredns", "kube-system", {"k8s-app": "kube-dns"})
# a Ray pod of vitserve's in another namespace: labels alike, not ours
NEIGHBOUR = Pod(
    "neighbour", "other", {"app.kubernetes.io/name": "vitserve", "ray.io/is-ray-node": "yes"}
)
INTERNET = Host("internet", "203.0.113.7")
API_SERVER = Host("api-server", "10.0.0.1")
PRIVATE = Host("private", "10.20.30.40")


def stand_ins(ns: str) -> list[Endpoint]:
    """Everyone else: a pod of our namespace the policies do not name, the other
    namespaces' pods, addresses outside."""
    stranger = Pod("stranger", ns, {"app": "stranger"})
    return [stranger, GATEWAY, MONITORING, OPERATOR, DNS, NEIGHBOUR, INTERNET, PRIVATE]


def namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **NAMESPACE_LABELS.get(name, {})}


# --- a NetworkPolicy evaluator ----------------------------------------------------------------


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels, matchExpressions) against ``labels``; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, op, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:  # addresses outside the pods (how CNIs treat pod IPs here varies)
        if not isinstance(other, Host):
            return False
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if isinstance(other, Host):
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], namespace_labels(other.namespace))
    else:
        in_namespace = other.namespace == policy_ns
    return in_namespace and selects(peer.get("podSelector"), other.labels)


def _container_port(pod: Endpoint, name: str) -> int | None:
    if not isinstance(pod, Pod) or pod.spec is None:
        return None
    for container in pod.spec["containers"]:
        for port in container.get("ports", []):
            if port.get("name") == name:
                return port["containerPort"]
    return None


def _port_matches(ports: list[dict[str, Any]] | None, dst: Endpoint, port: int, proto: str) -> bool:
    if not ports:
        return True
    for rule in ports:
        if rule.get("protocol", "TCP") != proto:
            continue
        if "port" not in rule:
            return True
        first = rule["port"]
        if isinstance(first, str):
            first = _container_port(dst, first)
            if first is None:
                continue
        if first <= port <= rule.get("endPort", first):
            return True
    return False


def _types(policy: dict[str, Any]) -> set[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return set(spec["policyTypes"])
    return {"Ingress"} | ({"Egress"} if "egress" in spec else set())


def _policies(objects: list[dict[str, Any]], pod: Pod, direction: str) -> list[dict[str, Any]]:
    ns = app_namespace(objects)
    return [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy"
        and p["metadata"].get("namespace", ns) == pod.namespace
        and direction in _types(p)
        and selects(p["spec"]["podSelector"], pod.labels)
    ]


def _allows(
    objects: list[dict[str, Any]], pod: Pod, other: Endpoint, port: int, proto: str, way: str
) -> bool:
    """Whether ``pod``'s policies let it take (``Ingress``) or open (``Egress``) a connection
    from/to ``other`` on ``port``: yes when no policy selects it for that direction, else
    when a rule of one of them names the peer and the port."""
    policies = _policies(objects, pod, way)
    if not policies:
        return True
    rules, peers = ("ingress", "from") if way == "Ingress" else ("egress", "to")
    dst = pod if way == "Ingress" else other
    for policy in policies:
        ns = policy["metadata"].get("namespace", pod.namespace)
        for rule in policy["spec"].get(rules, []):
            named = not rule.get(peers) or any(
                _peer_matches(peer, ns, other) for peer in rule[peers]
            )
            if named and _port_matches(rule.get("ports"), dst, port, proto):
                return True
    return False


def reachable(
    objects: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, proto: str = "TCP"
) -> bool:
    """May ``src`` open a connection to ``dst`` on ``port``? Both ends' policies must allow
    it; only our namespace has policies here (the other namespaces' and hosts' allow all)."""
    ours = app_namespace(objects)
    egress_checked = isinstance(src, Pod) and src.namespace == ours
    if egress_checked and not _allows(objects, src, dst, port, proto, "Egress"):  # type: ignore[arg-type]
        return False
    if isinstance(dst, Pod) and dst.namespace == ours:
        return _allows(objects, dst, src, port, proto, "Ingress")
    return True


def who_reaches(
    objects: list[dict[str, Any]], sources: Iterable[Endpoint], dst: Endpoint, port: int
) -> set[str]:
    return {s.name for s in sources if reachable(objects, s, dst, port)}


# --- network policies -------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_a_default_deny_covers_every_pod_both_ways(render: Render, target: str) -> None:
    objects = render(target)
    deny = [
        p
        for p in objects
        if p["kind"] == "NetworkPolicy"
        and p["spec"]["podSelector"] == {}
        and _types(p) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert deny, "no policy selects every pod for Ingress and Egress allowing nothing"
    # so a pod the policies do not name gets nothing, from anyone or to anywhere, but DNS
    ns = app_namespace(objects)
    stranger = Pod("stranger", ns, {"app": "stranger"})
    everyone = [*our_pods(objects).values(), *stand_ins(ns), API_SERVER]
    for port in (80, 443, 6379, 8000, 8080, 8265):
        assert who_reaches(objects, everyone, stranger, port) == set(), port
        assert {d.name for d in everyone if reachable(objects, stranger, d, port)} == set(), port
    assert reachable(objects, stranger, DNS, 53, "UDP")


@pytest.mark.parametrize("target", TARGETS)
def test_redis_is_reached_by_the_ray_pods_and_the_vllm_servers_alone(
    render: Render, target: str
) -> None:
    """Redis' 6379 from the Ray pods and the vLLM servers (their connector reads the store);
    a Redis Cluster's nodes also from each other (6379: replication; 16379: the cluster bus)
    and 6379 from its bootstrap Job; nothing else."""
    objects = render(target)
    pods = our_pods(objects)
    ray = {name for name, pod in pods.items() if pod.ray}
    everyone = [*pods.values(), *stand_ins(app_namespace(objects)), API_SERVER]
    cluster = target in CLUSTER_TARGETS
    assert ("redis-init" in pods) == cluster
    own = {"redis", "redis-init"} if cluster else set()
    assert who_reaches(objects, everyone, pods["redis"], 6379) == ray | own | {"vllm"}
    assert who_reaches(objects, everyone, pods["redis"], 16379) == ({"redis"} if cluster else set())
    for port in (6380, 26379, 8000):  # nothing else of Redis' reaches anyone
        assert who_reaches(objects, everyone, pods["redis"], port) == set(), port
    if cluster:  # the bootstrap reaches the nodes' 6379, nothing else
        init = pods["redis-init"]
        for dst in (*(pods[r] for r in ray), INTERNET, API_SERVER):
            for port in (443, 6379, 8000):
                assert not reachable(objects, init, dst, port), (dst.name, port)
        assert not reachable(objects, init, pods["redis"], 16379)


@pytest.mark.parametrize("target", TARGETS)
def test_ray_ports_stay_among_ray_pods_but_the_named_exceptions(
    render: Render, target: str
) -> None:
    """Every port of every Ray pod: the Ray pods reach it (Ray's ports are mostly random, so
    all of them); from anywhere else only Serve's 8000 from the gateway and the vLLM servers
    (their connector asks the encoder application for the model) (and, on the head, the
    operator's health check and Prometheus' scrape of vitserve's /metrics), the dashboard
    8265 from the operator, Ray's metrics 8080 from Prometheus."""
    objects = render(target)
    pods = our_pods(objects)
    ray = {name for name, pod in pods.items() if pod.ray}
    others = [
        *(pods[name] for name in ("redis", "redis-init", "vllm") if name in pods),
        *stand_ins(app_namespace(objects)),
        API_SERVER,
    ]
    ports = {6379, 8000, 8080, 8265, 10001, 52365, 8076, 8085, 10002, 19999, 20000, 30000}
    for name in ray:
        pod = pods[name]
        assert pod.spec is not None
        ports |= {p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])}
        head = name == "head"
        expected = {
            8000: {"gateway", "vllm"} | ({"kuberay-operator", "prometheus"} if head else set()),
            8080: {"prometheus"},
            8265: {"kuberay-operator"} if head else set(),
        }
        for port in sorted(ports):
            assert who_reaches(objects, [pods[r] for r in ray], pod, port) == ray, (name, port)
            allowed = who_reaches(objects, others, pod, port)
            assert allowed == expected.get(port, set()), (name, port)


@pytest.mark.parametrize("target", TARGETS)
def test_egress_is_dns_ray_redis_the_api_server_and_the_hub(render: Render, target: str) -> None:
    objects = render(target)
    pods = our_pods(objects)
    ray = [pod for pod in pods.values() if pod.ray]
    ns = app_namespace(objects)
    stranger = Pod("stranger", ns, {"app": "stranger"})
    for pod in pods.values():  # everyone resolves names
        assert reachable(objects, pod, DNS, 53, "UDP") and reachable(objects, pod, DNS, 53, "TCP")
        assert not reachable(objects, pod, DNS, 80), pod.name
        assert not reachable(objects, pod, stranger, 8000), pod.name
        assert not reachable(objects, pod, NEIGHBOUR, 6379), pod.name
        assert not reachable(objects, pod, INTERNET, 80), pod.name
    redis = pods["redis"]
    for dst in (*ray, INTERNET, API_SERVER, PRIVATE):
        for port in (443, 6443, 6379, 8000):
            assert not reachable(objects, redis, dst, port), (dst.name, port)
    for pod in ray:
        assert reachable(objects, pod, redis, 6379), pod.name
        assert all(reachable(objects, pod, other, 10002) for other in ray), pod.name
        assert reachable(objects, pod, INTERNET, 443), pod.name  # the model from the hub
        # the Kubernetes API: the head's autoscaler only (443 or 6443 behind the Service)
        head = pod.name == "head"
        assert reachable(objects, pod, API_SERVER, 6443) == head, pod.name
        assert reachable(objects, pod, PRIVATE, 443) == head, pod.name  # not the hub's rule


VLLM_PORT = 8000  # vLLM's OpenAI server (k8s/base/vllm.yaml): the API, /metrics, /health


@pytest.mark.parametrize("target", TARGETS)
def test_vllm_is_reached_by_the_front_and_prometheus_alone(render: Render, target: str) -> None:
    """vLLM's port from the Ray pods (the vLLM front, a Serve replica on any of them) and
    Prometheus (/metrics), nobody else (not Redis, the gateway, the operator, a pod of the
    namespace the policies do not name, vitserve's look-alike elsewhere, the internet); no
    other port of the vLLM pods from anyone."""
    objects = render(target)
    pods = our_pods(objects)
    vllm = pods["vllm"]
    assert _container_port(vllm, "http") == VLLM_PORT
    ray = {name for name, pod in pods.items() if pod.ray}
    everyone = [*pods.values(), *stand_ins(app_namespace(objects)), API_SERVER]
    assert who_reaches(objects, everyone, vllm, VLLM_PORT) == ray | {"prometheus"}
    for port in (22, 80, 443, 5557, 6379, 8001, 8080, 8265, 29500):  # ZMQ, torch, ...
        assert who_reaches(objects, everyone, vllm, port) == set(), port
    for name in ray:  # ... and the Ray pods' own policies let the front open them
        assert reachable(objects, pods[name], vllm, VLLM_PORT), name
        assert not reachable(objects, pods[name], vllm, 8001), name


@pytest.mark.parametrize("target", TARGETS)
def test_vllm_reaches_redis_the_encoder_dns_and_the_hub_alone(render: Render, target: str) -> None:
    """The vLLM servers open connections to Redis' 6379 (the connector's store: a Redis
    Cluster's nodes included), Serve's 8000 on the Ray pods (the connector asks the encoder
    application for the model and its namespace, through KubeRay's serve Service), DNS, and
    where their weights come from the hub (not cpu-dev: it builds the demo model in the pod)
    public addresses on 443; nothing else: no other Ray port, not the API server, no private
    address, no pod elsewhere."""
    objects = render(target)
    pods = our_pods(objects)
    vllm = pods["vllm"]
    ns = app_namespace(objects)
    stranger = Pod("stranger", ns, {"app": "stranger"})
    assert reachable(objects, vllm, DNS, 53, "UDP") and reachable(objects, vllm, DNS, 53, "TCP")
    assert reachable(objects, vllm, pods["redis"], 6379)
    assert not reachable(objects, vllm, pods["redis"], 16379)  # not the cluster's bus
    ray = [pod for pod in pods.values() if pod.ray]
    for pod in ray:
        assert reachable(objects, vllm, pod, 8000), pod.name
        for port in (6379, 8080, 8265, 10001, 52365, 10002):  # GCS, metrics, dashboard, ...
            assert not reachable(objects, vllm, pod, port), (pod.name, port)
    hub = target != "cpu-dev"
    assert reachable(objects, vllm, INTERNET, 443) == hub
    for dst, port in (
        (INTERNET, 80),
        (PRIVATE, 443),
        (API_SERVER, 443),
        (API_SERVER, 6443),
        (stranger, 8000),
        (NEIGHBOUR, 6379),
        (NEIGHBOUR, 8000),
        (GATEWAY, 8000),
        (MONITORING, 9090),
        (vllm, 8000),  # not each other either
    ):
        assert not reachable(objects, vllm, dst, port), (dst.name, port)
    if "redis-init" in pods:
        assert not reachable(objects, vllm, pods["redis-init"], 6379)


@pytest.mark.parametrize("target", TARGETS)
def test_prometheus_reaches_what_the_pod_monitors_scrape(render: Render, target: str) -> None:
    objects = render(target)
    pods = our_pods(objects)
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        selected = [p for p in pods.values() if selects(monitor["spec"]["selector"], p.labels)]
        assert selected, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for pod in selected:
                port = _container_port(pod, endpoint["port"])
                assert port is not None, (monitor["metadata"]["name"], endpoint["port"])
                assert reachable(objects, MONITORING, pod, port), (pod.name, port)


# --- auth -------------------------------------------------------------------------------------


def _secret_file(pod: Pod, container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path`` in ``container``: a Secret volume mounted as a
    directory (subPath mounts never see a Secret's updates)."""
    assert pod.spec is not None
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        if posixpath.dirname(path) == mount["mountPath"].rstrip("/"):
            assert "subPath" not in mount and "subPathExpr" not in mount, mount
            secret = volumes[mount["name"]]["secret"]
            name = posixpath.basename(path)
            keys = {i["path"]: i["key"] for i in secret.get("items", [])} or {name: name}
            return secret["secretName"], keys[name]
    raise AssertionError(f"{path} is on no mounted volume of {pod.name}/{container['name']}")


@pytest.mark.parametrize("target", TARGETS)
def test_every_application_has_auth_on_from_the_mounted_secret(
    render: Render, target: str, tmp_path: Path
) -> None:
    from vitserve.deployments.common.auth import Authenticator

    objects = render(target)
    rayservice = one(objects, "RayService")
    pods = our_pods(objects)
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    for group, template in pod_templates(rayservice).items():
        environ = pod_environ(objects, template)
        container = pods[group].spec["containers"][0]  # type: ignore[index]
        for app in applications(rayservice).values():
            cfg = VitserveConfig.load(app["args"], environ=environ)
            assert cfg.auth.enabled, (group, app["name"])
            assert (cfg.auth.tokens_file, cfg.auth.scrape_token_file) == (
                TOKENS_FILE,
                SCRAPE_TOKEN_FILE,
            )
            for path, key in ((TOKENS_FILE, "tokens"), (SCRAPE_TOKEN_FILE, "scrape-token")):
                assert _secret_file(pods[group], container, path) == (TOKENS_SECRET, key)
            if TOKENS_SECRET not in secrets:  # base, gpu-prod: created beforehand
                continue
            # cpu-dev generates it: the applications start with its content
            data = {
                k: base64.b64decode(v).decode() for k, v in secrets[TOKENS_SECRET]["data"].items()
            }
            for key, text in data.items():
                (tmp_path / key).write_text(text)
            auth = Authenticator.from_config(
                cfg.model_copy(
                    update={
                        "auth": cfg.auth.model_copy(
                            update={"tokens_file": str(tmp_path / "tokens")}
                        )
                    }
                )
            )
            # `dev`, and `vllm`: the vLLM connector's (test_vllm.py)
            assert auth is not None and [t.name for t in auth.tenants()] == ["dev", "vllm"]
            assert len(data["scrape-token"].strip()) >= MIN_TOKEN_CHARS


@pytest.mark.parametrize("target", TARGETS)
def test_the_pod_monitor_sends_the_scrape_token_to_vitserves_routes(
    render: Render, target: str
) -> None:
    objects = render(target)
    pods = our_pods(objects)
    scraped = 0
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        selected = [p for p in pods.values() if selects(monitor["spec"]["selector"], p.labels)]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            ports = {_container_port(p, endpoint["port"]) for p in selected}
            if {p.name for p in selected} == {"vllm"}:  # vLLM's /metrics: no credentials
                assert ports == {VLLM_PORT} and "authorization" not in endpoint, endpoint
            elif ports == {8000}:  # Serve's port: vitserve's /metrics routes, auth on
                assert all(p.ray for p in selected), endpoint
                assert endpoint["authorization"] == {
                    "type": "Bearer",
                    "credentials": {"name": TOKENS_SECRET, "key": "scrape-token"},
                }, endpoint
                scraped += 1
            else:  # Ray's exporter (metrics-export-port) takes no credentials
                assert ports == {8080}, endpoint
    assert scraped == 2  # /metrics and /prefill/metrics


# --- containers -------------------------------------------------------------------------------


def _containers(pod: Pod) -> list[dict[str, Any]]:
    assert pod.spec is not None
    return [*pod.spec.get("initContainers", []), *pod.spec["containers"]]


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_runs_hardened(render: Render, target: str) -> None:
    """Non-root, no privilege escalation, no capabilities, seccomp RuntimeDefault, read-only
    root: for every container of every pod, KubeRay's own included (the autoscaler takes
    autoscalerOptions.securityContext, wait-gcs-ready the Ray container's)."""
    objects = render(target)
    seen = set()
    for pod in our_pods(objects).values():
        pod_context = pod.spec.get("securityContext", {})  # type: ignore[union-attr]
        for container in _containers(pod):
            where = f"{pod.name}/{container['name']}"
            seen.add(container["name"])
            own = container.get("securityContext", {})
            effective = {**pod_context, **own}
            assert effective.get("runAsNonRoot") is True, where
            assert effective.get("runAsUser") not in (None, 0), where
            assert effective.get("seccompProfile") == {"type": "RuntimeDefault"}, where
            assert own.get("allowPrivilegeEscalation") is False, where
            assert own.get("privileged") is not True, where
            assert own.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not own.get("capabilities", {}).get("add"), where
            assert own.get("readOnlyRootFilesystem") is True, where
            uid = effective["runAsUser"]
            redis_image = container["image"].startswith("redis:")  # Redis' user; vitserve's else
            assert uid == (REDIS_UID if redis_image else RAY_UID), where
    assert {"ray-head", "redis", "redis-acl", "vllm"} <= seen
    if target != "cpu-dev":
        assert {"autoscaler", "ray-worker", "wait-gcs-ready"} <= seen
    else:
        assert "demo-model" in seen  # the vLLM pod's init container (test_vllm.py)


def _writable(pod: Pod, container: dict[str, Any], path: str) -> str | None:
    """The volume ``path`` is written to in ``container`` (the deepest mount holding it, not
    read-only), or None: the container's root filesystem."""
    assert pod.spec is not None
    best = None
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/")
        holds = path == root or path.startswith(root + "/")
        if holds and (best is None or len(root) > len(best["mountPath"].rstrip("/"))):
            best = mount
    if best is None or best.get("readOnly"):
        return None
    return best["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_a_read_only_root_leaves_every_written_path_on_a_volume(
    render: Render, target: str
) -> None:
    objects = render(target)
    pods = our_pods(objects)
    for group in pod_templates(one(objects, "RayService")):
        pod = pods[group]
        ray = pod.spec["containers"][0]  # type: ignore[index]
        env = {e["name"]: e.get("value") for e in ray.get("env", [])}
        config = one(objects, "ConfigMap", "vitserve-config")["data"]
        # Ray's temp and session dirs, the object store, the HF and vitserve caches
        paths = ["/tmp", "/tmp/ray", "/dev/shm", env["HF_HOME"], config["VITSERVE_CACHE"]]
        for path in paths:
            assert _writable(pod, ray, path), (group, path)
        for container in pod.spec["containers"][1:]:  # type: ignore[index]
            assert container["name"] == "autoscaler"
            assert _writable(pod, container, "/tmp"), group
            # its logs and events, read by the head: the same volume in both
            assert _writable(pod, container, "/tmp/ray") == _writable(pod, ray, "/tmp/ray")
    redis = pods["redis"]
    (server,) = redis.spec["containers"]  # type: ignore[index]
    flags = {name: values for name, *values in redis_directives(server["args"])}
    assert _writable(redis, server, flags["--dir"][0])
    (init,) = redis.spec["initContainers"]  # type: ignore[index]
    out = init["command"][init["command"].index("--out") + 1]
    assert _writable(redis, init, out)
    # vLLM: HOME (~/.cache/vllm, ~/.triton, ~/.config), /tmp (torch's inductor cache, IPC
    # sockets), /dev/shm, the weights (HF_HOME); the demo model's builder: its cache, its link
    vllm = pods["vllm"]
    for container in _containers(vllm):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        paths = ["/tmp", env["HOME"]]
        if container["name"] == "vllm":
            paths += ["/dev/shm", f"{env['HOME']}/.cache", env["HF_HOME"]]
        else:
            assert container["name"] == "demo-model", container["name"]
            paths += [env["VITSERVE_CACHE"], posixpath.dirname(env["DEMO_MODEL_DIR"])]
        for path in paths:
            assert _writable(vllm, container, path), (container["name"], path)


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_and_empty_dir_bounds_its_storage(render: Render, target: str) -> None:
    """ephemeral-storage requests and limits on every container (but KubeRay's
    wait-gcs-ready, whose resources KubeRay fixes; it writes nothing), a sizeLimit on every
    emptyDir (KubeRay's own included: it adds unbounded ones when a mount is missing), and
    the disk-backed emptyDirs within the pod's ephemeral-storage limit."""
    objects = render(target)
    for pod in our_pods(objects).values():
        assert pod.spec is not None
        limit = 0
        for container in _containers(pod):
            if container.get("kuberay_injected"):
                continue
            resources = container["resources"]
            where = f"{pod.name}/{container['name']}"
            assert "ephemeral-storage" in resources.get("requests", {}), where
            assert "ephemeral-storage" in resources.get("limits", {}), where
            limit += size_bytes(resources["limits"]["ephemeral-storage"])
        on_disk = 0
        memory = sum(size_bytes(c["resources"]["limits"]["memory"]) for c in pod.spec["containers"])
        for volume in pod.spec.get("volumes", []):
            if "emptyDir" not in volume:
                continue
            size = volume["emptyDir"].get("sizeLimit")
            assert size, f"{pod.name}: emptyDir {volume['name']} has no sizeLimit"
            if volume["emptyDir"].get("medium") == "Memory":
                assert size_bytes(size) < memory, (pod.name, volume["name"])
            else:
                on_disk += size_bytes(size)
        assert on_disk < limit, (pod.name, on_disk, limit)


# --- disruption budgets -----------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_disruption_budgets_select_exactly_the_head_redis_and_vllm(
    render: Render, target: str
) -> None:
    objects = render(target)
    pods = our_pods(objects)
    ns = app_namespace(objects)
    candidates = [*pods.values(), *(p for p in stand_ins(ns) if isinstance(p, Pod))]
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    selected = {
        name: {
            p.name
            for p in candidates
            if p.namespace == budget["metadata"].get("namespace", ns)
            and selects(budget["spec"]["selector"], p.labels)
        }
        for name, budget in budgets.items()
    }
    assert selected == {
        "vitserve-ray-head": {"head"},
        "vitserve-redis": {"redis"},
        "vitserve-vllm": {"vllm"},
    }
    for name, budget in budgets.items():
        spec = budget["spec"]
        if name == "vitserve-redis" and target in CLUSTER_TARGETS:
            # six pods: one at a time (a primary's replica takes over; no data leaves)
            assert spec.get("maxUnavailable") == 1, spec
        elif name == "vitserve-vllm":  # independent servers: one at a time
            assert spec.get("maxUnavailable") == 1, spec
        else:
            # one pod: no voluntary eviction of a ready one (a drain waits for an operator)
            assert spec.get("maxUnavailable") == 0 or spec.get("minAvailable") == 1, spec
        assert spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow", spec


def test_the_namespace_labels_the_policies_expect_are_documented() -> None:
    readme = (K8S / "README.md").read_text()
    for label in ("vitserve.io/gateway", "vitserve.io/monitoring", "kuberay-system"):
        assert label in readme, label
