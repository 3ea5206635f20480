"""What ``vitserve serve`` exposes beyond this machine (issue 28's first step).

* Its HTTP port: a host other than loopback is refused unless vitserve's auth is configured or
  ``--insecure`` is given; the refusal says why and starts nothing.
* Its Ray cluster, run as a user runs it (no ``RAY_AUTH_MODE`` in the environment): no socket
  its processes listen on beyond loopback answers a connection without Ray's token (gRPC:
  UNAUTHENTICATED; HTTP: 401); one that answers fails the test. ``start_ray`` gives the embedded
  cluster a loopback node address (``local.LOCAL_NODE_ONLY``), so Ray binds its ports on loopback,
  Ray's three Prometheus exporters included (the agent's metrics export port, the dashboard's and
  the autoscaler's), which answer metrics to anyone who reaches them: vitserve's own
  ``/metrics`` reads the agent's there, the others the embedded default does not need. Only each
  Serve replica's inter-deployment gRPC server still listens on every interface (Serve binds it
  to ``[::]``), and it refuses without the token. Ray's token auth stays on: on loopback too,
  GCS, raylets, workers and agents refuse a connection without it, and only the exporters
  answer (listed).
"""

from __future__ import annotations

import ipaddress
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from tests.cli_process import VITSERVE, cli_env, stop, wait_healthy
from vitserve.deployments.runner import cli, local, quiet
from vitserve.errors import ConfigError


# -- the HTTP host --------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_auth(host: str) -> None:
    local.check_exposure(local.local_config({"http_host": host}))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "vitserve.internal"])
def test_any_other_host_is_refused_without_auth_and_says_why(host: str) -> None:
    cfg = local.local_config({"http_host": host})
    with pytest.raises(ConfigError, match=f"refusing to listen on {host} without auth") as exc:
        local.check_exposure(cfg)
    assert "auth.tokens_file" in str(exc.value) and "--insecure" in str(exc.value)
    local.check_exposure(cfg, insecure=True)  # told
    tokens = {"auth.tokens": [{"tenant": "a", "token": "a-token-0123456789abcdef"}]}
    local.check_exposure(local.local_config({"http_host": host, **tokens}))


def test_serve_on_all_interfaces_without_auth_exits_before_starting_anything(
    monkeypatch, capsys
) -> None:
    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("start_local ran")

    monkeypatch.setattr(local, "start_local", started)
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "8765"]) == 2
    err = capsys.readouterr().err
    assert "vitserve: error: refusing to listen on 0.0.0.0 without auth" in err


# -- Ray's ports ----------------------------------------------------------------------------
# A method of each Ray gRPC service that listens here (any one answers UNAUTHENTICATED without
# the token on the port that serves it, UNIMPLEMENTED on the others).
RAY_METHODS = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
    "/ray.rpc.NodeManagerService/GetNodeStats",
    "/ray.rpc.ObjectManagerService/Push",
    "/ray.rpc.CoreWorkerService/GetCoreWorkerStats",
    "/ray.rpc.ReporterService/GetProfilingStats",
    "/ray.rpc.LogService/ListLogs",
    "/ray.serve.ASGIService/HandleRequest",  # a Serve replica's own server
)


REFUSED = ("grpc UNAUTHENTICATED", "http 401")


def _reachable_ip() -> str:
    """An address of this machine other than loopback (what a neighbour connects to)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    pytest.fail("this machine has no address beyond loopback")


def _is_loopback(bound: str) -> bool:
    """Whether a socket bound to ``bound`` is reached from this machine only (an IPv4 loopback
    mapped into IPv6, ``::ffff:127.0.0.1``, too: Python 3.11 does not call that loopback)."""
    addr = ipaddress.ip_address(bound)
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool((mapped or addr).is_loopback)


def _connect_host(bound: str, reachable: str) -> str:
    """The host to connect to a socket bound to ``bound`` at (URL form)."""
    if bound in ("0.0.0.0", "::"):
        return reachable
    addr = ipaddress.ip_address(bound)
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        return str(mapped)
    return f"[{addr}]" if addr.version == 6 else str(addr)


def _tokenless(host: str, port: int) -> str:
    """What a connection without Ray's token gets: ``grpc UNAUTHENTICATED``, ``http 401``,
    ``metrics`` (Prometheus text), or what else answered."""
    import grpc

    channel = grpc.insecure_channel(f"{host}:{port}")
    codes = []
    try:
        for method in RAY_METHODS:
            call = channel.unary_unary(method, lambda b: b, lambda b: b)
            try:
                call(b"", timeout=3)
                return f"grpc {method} answered"
            except grpc.RpcError as exc:
                codes.append(exc.code().name)
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return "grpc UNAUTHENTICATED"
    finally:
        channel.close()
    if "UNIMPLEMENTED" in codes:  # gRPC, and none of the methods tried is served there
        return f"grpc {codes}"
    try:
        r = httpx.get(f"http://{host}:{port}/", timeout=3)
    except httpx.HTTPError as exc:
        return f"http {type(exc).__name__}"
    if r.status_code == 401:
        return "http 401"
    if r.status_code == 200 and r.text.startswith("# HELP"):
        return "metrics"
    return f"http {r.status_code} {r.text[:80]!r}"


@pytest.mark.parametrize("bound", ["127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"])
def test_loopback_sockets_are_told_apart(bound: str) -> None:
    assert _is_loopback(bound)
    assert _connect_host(bound, "192.0.2.9") in ("127.0.0.1", "127.0.0.53", "[::1]")


@pytest.mark.parametrize("bound", ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "fe80::1"])
def test_any_other_socket_is_beyond_loopback(bound: str) -> None:
    assert not _is_loopback(bound)


def test_serve_as_a_user_runs_it_keeps_rays_token_auth_on_every_port_beyond_loopback(
    tmp_path: Path, tiny_models
) -> None:
    env = cli_env(tmp_path)
    env.pop("RAY_AUTH_MODE")  # as a user runs it
    env["RAY_TMPDIR"] = str(Path("/tmp") / f"vx-{tmp_path.name[-8:]}")  # Ray's short socket paths
    port = local.free_port()
    model = str(tiny_models["qwen2_vl"])
    log = tmp_path / "serve.log"  # a file, not a pipe: nobody reads a pipe until the end
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [VITSERVE, "serve", "--model", model, "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its group is killed if it does not stop: nothing leaks
        )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log=log)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        pids = {p.pid: p.name() for p in tree}
        listening = sorted(
            (c.laddr.ip, c.laddr.port, pids[c.pid])
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids
        )
        assert ("127.0.0.1", port) in {(ip, p) for ip, p, _ in listening}  # vitserve's HTTP
        # vitserve's /metrics still reads the agent's metrics exporter, now on loopback
        metrics_page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert metrics_page.status_code == 200, metrics_page.text
        # the node's timers (runner.quiet) reach Serve's processes, where they take effect
        serve_procs = [p for p in tree if "Serve" in p.name() or "Proxy" in p.name()]
        assert len(serve_procs) >= 3, [p.name() for p in tree]  # controller, proxy, replicas
        for p in serve_procs:
            assert quiet.QUIET_ENV.items() <= p.environ().items(), p.name()
        ip = _reachable_ip()
        probed = {
            (bound, p, name): _tokenless(_connect_host(bound, ip), p)
            for bound, p, name in listening
            if p != port
        }
    finally:
        code = stop(proc, signal.SIGINT)
    assert code == 0, log.read_text(errors="replace")[-4000:]
    print("\n".join(f"{b:>18} {p:>5} {n:<22} {v}" for (b, p, n), v in sorted(probed.items())))
    beyond = {k: v for k, v in probed.items() if not _is_loopback(k[0])}
    # the rule: nothing beyond loopback answers without Ray's token
    assert not {k: v for k, v in beyond.items() if v not in REFUSED}, beyond
    # Ray's token auth is on (GCS, raylet, workers, agents refuse), loopback or not ...
    assert sum(v in REFUSED for v in probed.values()) >= 4, probed
    # ... and on loopback only Ray's Prometheus exporters answer without it
    rest = {k: v for k, v in probed.items() if v not in REFUSED and v != "metrics"}
    assert not rest, rest
    metrics = sorted(k for k, v in probed.items() if v == "metrics")
    assert all("DashboardAgent" in n or n.startswith("python") for _, _, n in metrics), metrics
