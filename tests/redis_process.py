"""A private ``redis-server`` subprocess on a free port, for tests that stop, restart or
configure their own Redis (``spawn_redis`` in tests/conftest.py, tests/vllm), and a private
Redis Cluster of them (``redis_cluster_url``, ``spawn_redis_cluster``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class RedisServer:
    """A private redis-server subprocess on a free port (killed at teardown)."""

    def __init__(
        self, *args: str, pick_port: Callable[[], int] | None = None, tls: bool = False
    ) -> None:
        """``tls``: listen on TLS only (``--port 0 --tls-port``; ``args`` bring the
        certificates)."""
        from vitserve.deployments.runner.local import free_port

        self._pick_port = pick_port or free_port
        self.tls = tls
        self.port = self._pick_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, attempts: int = 3) -> None:
        """Start on ``self.port``; if the server exits at once (another process took the port
        since it was found free), on a new free port."""
        for _ in range(attempts):
            self.proc = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    *(("--port", "0", "--tls-port") if self.tls else ("--port",)),
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self.kill()
            self.port = self._pick_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
        raise RuntimeError(f"redis-server did not start ({attempts} ports tried)")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def cluster_port() -> int:
    """A free port for a cluster node: its cluster bus listens 10,000 above it, so the port is
    at most 55535 and that one is free too."""
    from vitserve.deployments.runner.local import free_port

    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterServers:
    """A private Redis Cluster on loopback: ``masters`` primaries with ``replicas`` replicas
    each, every node a :class:`RedisServer` in cluster mode (its own folder for its
    ``nodes.conf``, node timeout ``node_timeout_ms``), joined and given the slots by
    ``CLUSTER MEET``, ``ADDSLOTSRANGE`` and ``REPLICATE`` (so one primary works too, which
    ``redis-cli --cluster create`` refuses); ``args``: more redis-server options for every
    node; ``tls``: the certificates (``ca``, ``server``, ``client`` and their keys) to run every
    node on TLS only, its cluster bus and replication too (clients: ``url`` with
    ``url_options``). Killed at :meth:`close`."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        args: tuple[str, ...] = (),
        tls: dict[str, Path] | None = None,
    ) -> None:
        self.tls = tls
        self.root = Path(tempfile.mkdtemp(prefix="vitserve-redis-cluster-"))
        if tls is not None:
            args = (
                *args,
                "--tls-cert-file", str(tls["server"]),
                "--tls-key-file", str(tls["server-key"]),
                "--tls-ca-cert-file", str(tls["ca"]),
                # the bus and replication authenticate both ways: a node's outbound side
                # shows a client certificate
                "--tls-client-cert-file", str(tls["client"]),
                "--tls-client-key-file", str(tls["client-key"]),
                "--tls-auth-clients", "no",
                "--tls-cluster", "yes",
                "--tls-replication", "yes",
            )  # fmt: skip
        self.nodes: list[RedisServer] = []
        try:
            for i in range(masters * (1 + replicas)):
                folder = self.root / str(i)
                folder.mkdir()
                options = [
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--dir", str(folder),
                ]  # fmt: skip
                node = RedisServer(*options, *args, pick_port=cluster_port, tls=tls is not None)
                self.nodes.append(node)
            clients = [self.client(n.port) for n in self.nodes]
            ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            for c in clients[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            step = 16384 // masters
            for i, c in enumerate(clients[:masters]):
                last = 16383 if i == masters - 1 else (i + 1) * step - 1
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
            self._wait(lambda: all(self._known(c) == len(self.nodes) for c in clients))
            for j, c in enumerate(clients[masters:]):
                c.execute_command("CLUSTER", "REPLICATE", ids[j % masters])
            for c in clients:
                c.close()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        scheme = "rediss+cluster" if tls else "redis+cluster"
        self.url = f"{scheme}://127.0.0.1:{self.nodes[0].port}"
        self.url_options = f"ssl_ca_certs={tls['ca']}" if tls else ""

    def client(self, port: int) -> Any:
        """A plain client of one node (TLS when the cluster runs on it)."""
        import redis

        if self.tls is None:
            return redis.Redis(port=port, socket_timeout=5)
        return redis.Redis(port=port, socket_timeout=5, ssl=True, ssl_ca_certs=str(self.tls["ca"]))

    @staticmethod
    def _known(client: Any) -> int:
        return len(client.execute_command("CLUSTER", "NODES").decode().strip().splitlines())

    @staticmethod
    def _wait(ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ok():
                    return
            except OSError:
                pass
            except Exception as exc:  # redis-py's errors while a node starts or fails over
                if "redis" not in type(exc).__module__:
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become healthy")
            time.sleep(0.1)

    def info(self, node: RedisServer, section: str) -> dict[str, Any]:
        client = self.client(node.port)
        try:
            if section == "cluster":
                text = client.execute_command("CLUSTER", "INFO").decode()
                return dict(line.split(":", 1) for line in text.split() if ":" in line)
            return client.info(section)
        finally:
            client.close()

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until every running node sees the cluster ``ok`` with every slot served, and every
        running replica is in sync with its primary."""

        def healthy() -> bool:
            for node in self.running():
                cluster = self.info(node, "cluster")
                if (
                    cluster.get("cluster_state") != "ok"
                    or cluster.get("cluster_slots_ok") != "16384"
                ):
                    return False
                replication = self.info(node, "replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False
            return True

        self._wait(healthy, timeout_s)

    def running(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None]

    def primary_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        client = self.client(self.running()[0].port)
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        finally:
            client.close()
        raise LookupError(f"no node serves the slot of {key!r}")

    def primaries(self) -> list[RedisServer]:
        return [n for n in self.running() if self.info(n, "replication")["role"] == "master"]

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again on its port; it rejoins from its ``nodes.conf`` (a primary
        that was replaced comes back as a replica of its successor)."""
        node.start(attempts=1)

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)
