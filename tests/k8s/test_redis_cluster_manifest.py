"""gpu-prod's Redis Cluster (k8s/overlays/gpu-prod/redis.yaml, redis-cluster-init.yaml) brought
up from the manifest itself on this machine: the StatefulSet's init container (``vitserve
redis-acl``) writes the aclfile and the replicas' ``masterauth`` include for each of the six
pods (their volumes stood in for by folders), six redis-servers start with the Redis
container's own arguments (``$(VAR)`` expanded with each pod's name; only the port, and the
announced name, which would need the cluster's DNS, are this machine's), and the bootstrap Job's
script from its ConfigMap joins them. Then: the cluster is whole, each replica replicates as
the cluster's own user, the script run again leaves it as it is, and the stores the Ray pods
compose (the writer's, the prefill's reader's) publish and read through it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import redis

from tests.k8s.test_manifests import (
    container_environ,
    expand,
    one,
    pod_environ,
    pod_templates,
)
from tests.k8s.test_redis_acl import STAND_INS, Pod, _acl_users, run_init_container
from tests.redis_process import RedisServer, cluster_port
from vitserve.cache.base import Claim
from vitserve.cache.codec import encode_record
from vitserve.cache.urls import open_store
from vitserve.testing.records import make_record

Render = Callable[[str], list[dict[str, Any]]]
CLUSTER_PASSWORD = "cluster-pw-not-in-the-manifest"
SECRETS = {**STAND_INS, "vitserve-redis-cluster": {"password": CLUSTER_PASSWORD}}


@pytest.fixture(scope="module")
def cluster(render: Render, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    objects = render("gpu-prod")
    statefulset = one(objects, "StatefulSet", "vitserve-redis")
    replicas = statefulset["spec"]["replicas"]
    servers: list[RedisServer] = []
    pods: list[Pod] = []
    try:
        for i in range(replicas):
            pod = Pod(statefulset, SECRETS, tmp_path_factory.mktemp(f"redis-{i}"))
            result = run_init_container(objects, pod)
            assert result.returncode == 0, result.stderr
            container = pod.container("redis")
            env = container_environ(objects, container, pod_name=f"vitserve-redis-{i}")
            args = [pod.local(container, expand(arg, env)) for arg in container["args"]]
            assert not any("$(" in arg for arg in args), args
            # this machine's: the announced name would need the cluster's DNS
            at = args.index("--cluster-announce-hostname")
            assert args[at + 1] == f"vitserve-redis-{i}.vitserve-redis-nodes"
            args[at + 1] = "127.0.0.1"
            servers.append(RedisServer(*args, pick_port=cluster_port))
            pods.append(pod)
        yield {"objects": objects, "servers": servers, "pods": pods}
    finally:
        for server in servers:
            server.kill()


def _bootstrap(cluster: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The Job's container as the kubelet would start it: its command on the ConfigMap's
    script, its environment (NODES pointed at this machine's servers), the Secret's file."""
    objects = cluster["objects"]
    job = one(objects, "Job", "vitserve-redis-cluster-init")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    script = one(objects, "ConfigMap", "vitserve-redis-cluster-init")["data"]["init.sh"]
    folder = cluster["pods"][0].root
    (folder / "init.sh").write_text(script)
    (folder / "job-password").write_text(CLUSTER_PASSWORD + "\n")
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NODES"].split() == [
        f"vitserve-redis-{i}.vitserve-redis-nodes:6379" for i in range(6)
    ]
    env["NODES"] = " ".join(f"127.0.0.1:{s.port}" for s in cluster["servers"])
    env["CLUSTER_PASSWORD_FILE"] = str(folder / "job-password")
    assert container["command"][:2] == ["sh", "/etc/vitserve/init/init.sh"]
    return subprocess.run(
        [shutil.which("sh") or "sh", str(folder / "init.sh")],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _as_cluster_user(port: int) -> redis.Redis:
    return redis.Redis(
        port=port, username="vitserve-cluster", password=CLUSTER_PASSWORD, socket_timeout=5
    )


def test_the_manifest_brings_up_a_whole_cluster_whose_stores_work(cluster: dict[str, Any]) -> None:
    users = _acl_users((cluster["pods"][0].root / "acl" / "users.acl").read_text())
    assert {"default", "vitserve-writer", "vitserve-reader", "vitserve-cluster"} <= set(users)
    result = _bootstrap(cluster)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ports = [s.port for s in cluster["servers"]]
    deadline = time.monotonic() + 60
    while True:  # every node sees it whole; every replica replicates as vitserve-cluster
        states = []
        for port in ports:
            client = _as_cluster_user(port)
            try:
                info = client.execute_command("CLUSTER", "INFO").decode()
                replication = client.info("replication")
            finally:
                client.close()
            states.append(
                "cluster_state:ok" in info
                and "cluster_slots_ok:16384" in info
                and replication.get("master_link_status", "up") == "up"
            )
        roles = []
        for port in ports:
            client = _as_cluster_user(port)
            roles.append(client.info("replication")["role"])
            client.close()
        if all(states) and sorted(roles) == ["master"] * 3 + ["slave"] * 3:
            break
        assert time.monotonic() < deadline, (states, roles)
        time.sleep(0.5)
    again = _bootstrap(cluster)  # the Job again (the next apply): the cluster left as it is
    assert again.returncode == 0 and "formed already" in again.stdout, again.stdout
    # the stores the Ray pods compose: their Redis tier, pointed at this machine's first node
    objects = cluster["objects"]
    environ = pod_environ(objects, pod_templates(one(objects, "RayService"))["head"])

    def redis_tier(url: str) -> str:
        l2 = dict(parse_qsl(urlsplit(url).query))["l2"]
        return l2.replace("@vitserve-redis:6379", f"@127.0.0.1:{ports[0]}")

    writer = open_store(redis_tier(environ["VITSERVE_STORE"]), namespace="k8s-cluster")
    reader = open_store(redis_tier(environ["VITSERVE_PREFILL__STORE"]), namespace="k8s-cluster")
    try:
        records = [make_record(rows=32, width=16, seed=i) for i in range(12)]
        keys = [r.key for r in records]
        assert writer.lookup_or_claim(keys, 30.0) == [Claim.WON] * len(keys)
        writer.put_values(
            [(r.key, encode_record(r)) for r in records], release=[(k, writer.token) for k in keys]
        )
        for record in records:
            got = reader.get_rows(record.key, 8, 24)
            assert got is not None and (got.embedding == record.embedding[8:24]).all()
        assert writer.stats()["shards"] == 3
    finally:
        writer.close()
        reader.close()
