"""The embedded default: a local Ray cluster running the vitserve application on one port.

Used by ``vitserve serve`` (``--prefill``: with the prefill application beside the encoder's)
and ``vitserve demo``: local Ray, the node-local store, no Redis, no dashboard, access logs off.
Everything a user needs to run it offline.

Its Ray cluster keeps Ray's token authentication, on by default for a new local cluster since
Ray 2.60 (Ray writes a token to ``~/.ray/auth_token``), and ``start_ray`` gives the cluster a
loopback node address, so Ray binds its ports on loopback (its metrics exporters included, which
answer without the token), except each Serve replica's inter-deployment gRPC server (``[::]``),
which refuses a connection without the token. vitserve never turns the token off; an
environment that sets ``RAY_AUTH_MODE=disabled`` itself (the tests) does. (Setting it here
would come too late: Ray reads the mode once, when this process first loads it.)
``check_exposure`` refuses an HTTP host other than loopback without vitserve's own auth.

Stopping (:func:`stop_local`) is graceful and bounded: the HTTP ingresses stop taking requests
(503) and let those in flight finish for up to ``grace_s``, answering the rest 503
(:mod:`vitserve.deployments.common.lifecycle`); then the cluster this process started is shut down
as a whole. Serve's own shutdown is skipped for such a cluster: it closes the HTTP proxy under
the requests in flight and took 5-60 s (its controller's shutdown timing out at 30 s), while
the cluster's processes, and every store entry held in them, end with ``ray.shutdown``
anyway. Measured on a 2-vCPU EPYC: ``ray.shutdown`` of the demo's cluster ~1.4 s.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import threading
import time
from typing import Any

from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.runner import quiet
from vitserve.errors import ConfigError

APP_NAME = "vitserve"
PREFILL_APP_NAME = "vitserve-prefill"
VLLM_APP_NAME = "vitserve-vllm"
# Ray runs its workers at nice 15 to favour the driver; here the replicas are the work (the
# driver only waits), and at nice 15 every bit of background activity preempted the encoder's
# compute threads: 448px forwards measured ~10% slower in a replica than in-process.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}
# The embedded cluster is one node of this process that nothing else joins, so its node address is
# loopback, and with it every port Ray opens but a Serve replica's inter-deployment gRPC server
# (bound to [::] in ray/serve/_private/replica.py; it refuses without Ray's token, which stays
# on). That includes Ray's three Prometheus exporters, which answer anyone without the token:
# for a loopback node they bind loopback (``is_localhost`` in ray/dashboard/modules/reporter/
# reporter_agent.py: the agent's metrics export port; ray/dashboard/head.py: port 44227;
# ray/autoscaler/_private/monitor.py and v2/monitor.py: port 44217). They stay on rather than
# off (``enable_metrics_collection``): vitserve serves its own metrics on its HTTP port's
# /metrics, which reads the agent's exporter (common.metrics.node_metrics_url); the embedded
# default needs none of them beyond loopback. Ray turns a loopback ``_node_ip_address`` into the
# machine's address unless ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` is off (its
# local-only mode, the default on macOS and Windows: ray/_private/services.py
# get_node_ip_address). Its env var (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) is read when Ray is first
# imported, before start_ray (build_application imports Serve), so start_ray turns the constant
# off while ray.init starts the node; the node's processes get its address on their command line.
LOCAL_NODE_ONLY = "ENABLE_RAY_CLUSTER"
#: the signals that stop ``vitserve serve`` (its handlers survive ray.init: ``start_ray``)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: how long a stop lets the requests in flight finish before answering them 503
DEFAULT_GRACE_S = 5.0
# What this process started: its own cluster (True) or joined one, and the stop signal.
_started: dict[str, Any] = {"own_cluster": False, "stop_signal": None}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(cfg: VitserveConfig, insecure: bool = False) -> None:
    """ConfigError when ``cfg`` listens beyond loopback with vitserve's auth off, unless told
    ``insecure``: anyone who reaches the port could then encode, probe for and read every
    embedding."""
    if is_loopback(cfg.http_host) or cfg.auth.enabled or insecure:
        return
    raise ConfigError(
        f"refusing to listen on {cfg.http_host} without auth: anyone who reaches this port "
        "could encode, probe for and read every embedding. Configure tokens "
        "(--set auth.tokens_file=PATH, one tenant:token a line), listen on 127.0.0.1, or "
        "pass --insecure to accept it"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _logging(access_log: bool) -> dict[str, Any]:
    return {"enable_access_log": access_log, "log_level": "WARNING"}


def start_ray(num_cpus: int | None = None) -> None:
    """A new local Ray cluster for this process (unless one is up already)."""
    import ray  # heavy: the CLI imports this module; Ray loads when a command starts it
    from ray._private import ray_constants

    if not ray.is_initialized():
        _started["own_cluster"] = True
        quiet.apply()  # the node's timers, where the environment leaves them unset
        # Local-only while the node starts: its address, and so every port, is loopback
        # (LOCAL_NODE_ONLY). getattr first: a Ray without the constant fails here, not silently.
        cluster = getattr(ray_constants, LOCAL_NODE_ONLY)
        setattr(ray_constants, LOCAL_NODE_ONLY, False)
        # ray.init replaces the driver's SIGTERM handler with sys.exit: the caller's (``vitserve
        # serve`` catches SIGINT and SIGTERM to drain) is put back once the node is up.
        main = threading.current_thread() is threading.main_thread()
        handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
        try:
            # address="local": always a new cluster of this process, never someone else's.
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level="warning",
                log_to_driver=False,
                _system_config=LOCAL_SYSTEM_CONFIG,
            )
        finally:
            setattr(ray_constants, LOCAL_NODE_ONLY, cluster)
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)


def start_serve(host: str, port: int, *, access_log: bool = False) -> str:
    """Serve's HTTP proxy on ``host:port`` in the running cluster; its base URL."""
    from ray import serve  # heavy: the CLI imports this module; Ray loads when a command starts it

    serve.start(http_options={"host": host, "port": port}, logging_config=_logging(access_log))
    return f"http://{host}:{port}"


#: how often a deploy asks Serve whether its application runs (``serve.run`` asks every 1 s:
#: each deploy waited half a second on average past the moment its replicas were up)
READY_POLL_S = 0.1


def serve_app(
    app: Any, *, name: str = APP_NAME, route_prefix: str = "/", access_log: bool = False
) -> None:
    """Deploy a built application and wait until it runs (asked every ``READY_POLL_S``); a
    deploy that fails raises RuntimeError with Serve's messages, the application's and each
    deployment's (``serve.run`` names the failed deployments, not why they failed)."""
    from ray import serve  # heavy: the CLI imports this module; Ray loads when a command starts it

    target = serve.RunTarget(
        app, name=name, route_prefix=route_prefix, logging_config=_logging(access_log)
    )
    serve.run_many([target], wait_for_applications_running=False)
    wait_running(name)


def application_statuses() -> dict[str, Any]:
    """Every Serve application's status overview (``StatusOverview``: the application's status
    and message, each deployment's), by name, read through Serve's client as ``serve.run`` reads
    it: one controller call of protobuf bytes, about a millisecond of the caller's CPU.
    (``serve.status()`` asks the controller for every detail and rebuilds each deployment's
    config, pickling its request router class: ~80 ms of the caller's CPU per call with three
    applications up, measured on a 2-vCPU EPYC: a 0.1 s poll of it took most of a core.)"""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    return {overview.name: overview for overview in client.list_serve_statuses()}


def wait_running(name: str, poll_s: float = READY_POLL_S) -> None:
    """Return once Serve's application ``name`` is RUNNING; RuntimeError when its deploy
    failed or it is gone (deleted meanwhile). Waits as long as Serve deploys, as ``serve.run``
    does: a deploy that hangs (replicas that never fit the cluster) is the caller's to bound."""
    from ray.serve.schema import ApplicationStatus

    while True:
        overview = application_statuses().get(name)
        if overview is None:
            raise RuntimeError(f"Deploying application {name} failed: it is gone")
        status = overview.app_status
        if status.status == ApplicationStatus.RUNNING:
            return
        if status.status == ApplicationStatus.DEPLOY_FAILED:
            why = [status.message] + [
                f"{d.name}: {d.message}" for d in overview.deployment_statuses if d.message
            ]
            raise RuntimeError(f"Deploying application {name} failed: " + "; ".join(why))
        time.sleep(poll_s)


def start_local(
    cfg: VitserveConfig, *, num_cpus: int | None = None, prefill: bool = False, vllm: bool = False
) -> str:
    """Start local Ray (unless already up), Serve on ``cfg.http_host:cfg.http_port``, and the
    encoder application (``vitserve``, at ``/``); with ``prefill``, the prefill application
    too (``vitserve-prefill``, at ``cfg.prefill.route_prefix``, reaching the encoder
    application by its handle); with ``vllm``, the vLLM front (``vitserve-vllm``, at
    ``cfg.vllm.route_prefix``, forwarding to ``cfg.vllm.urls``, reaching the encoder
    application by its handle). Returns the base URL once they answer."""
    # heavy (Ray Serve, FastAPI): the CLI imports this module
    from vitserve.deployments.encoder.app import build_application

    app = build_application(cfg)  # a model that cannot load fails here, before Ray starts
    chat = None
    if prefill:
        # heavy (Ray Serve, FastAPI): the CLI imports this module
        from vitserve.deployments.prefill.app import build_prefill_application

        cfg = cfg.model_copy(
            update={
                "prefill": cfg.prefill.model_copy(
                    update={"encoder_app": APP_NAME, "encoder_url": None}
                )
            }
        )
        chat = build_prefill_application(cfg)
    front = None
    if vllm:
        # heavy (Ray Serve, FastAPI): the CLI imports this module
        from vitserve.deployments.vllm.app import build_vllm_application

        cfg = cfg.model_copy(
            update={
                "vllm": cfg.vllm.model_copy(update={"encoder_app": APP_NAME, "encoder_url": None})
            }
        )
        front = build_vllm_application(cfg)  # no vllm.urls: an error before Ray starts
    start_ray(num_cpus)
    if _started["own_cluster"] and _started["stop_signal"] is None:
        # before the applications, so that their replicas find it (one per cluster)
        # heavy (the store, Starlette): the CLI imports this module
        from vitserve.deployments.common.lifecycle import open_stop_signal

        _started["stop_signal"] = open_stop_signal()
    url = start_serve(cfg.http_host, cfg.http_port, access_log=cfg.access_log)
    serve_app(app, access_log=cfg.access_log)
    if chat is not None:
        serve_app(
            chat,
            name=PREFILL_APP_NAME,
            route_prefix=cfg.prefill.route_prefix,
            access_log=cfg.access_log,
        )
    if front is not None:
        serve_app(
            front, name=VLLM_APP_NAME, route_prefix=cfg.vllm.route_prefix, access_log=cfg.access_log
        )
    return url


def stop_local(grace_s: float = DEFAULT_GRACE_S) -> dict[str, Any]:
    """Stop what :func:`start_local` started, gracefully (see the module docstring): drain the
    HTTP ingresses for up to ``grace_s`` (0: no drain), then shut the cluster down. Returns
    the drain's counts (``finished``, ``cut``, ``refused`` requests, ``replicas`` drained,
    ``missing`` replicas that did not report) and ``seconds`` the whole stop took."""
    import ray  # heavy: the CLI imports this module; Ray loads when a command starts it
    from ray import serve

    started = time.monotonic()
    counts: dict[str, Any] = {}
    signal, _started["stop_signal"] = _started["stop_signal"], None
    if signal is not None and grace_s > 0 and ray.is_initialized():
        # heavy (the store, Starlette): the CLI imports this module
        from vitserve.deployments.common.lifecycle import drain_all

        try:
            counts = drain_all(signal, grace_s)
        except Exception as exc:  # a drain that fails must not keep the process up
            counts = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if not _started["own_cluster"]:
        serve.shutdown()  # a cluster someone else runs outlives this process: clean up Serve
    ray.shutdown()
    _started["own_cluster"] = False
    return {**counts, "seconds": round(time.monotonic() - started, 2)}


def local_config(overrides: dict[str, Any]) -> VitserveConfig:
    """The config of a local run: the environment and ``overrides`` over the defaults; port 0
    picks a free port."""
    cfg = VitserveConfig.load(overrides)
    if cfg.http_port == 0:
        cfg = cfg.model_copy(update={"http_port": free_port(cfg.http_host)})
    return cfg
