"""The embedded default: a local Ray cluster running the vitserve application on one port.

Used by ``vitserve serve`` (``--prefill``: with the prefill application beside the encoder's)
and ``vitserve demo``: local Ray, the node-local store, no Redis, no dashboard, access logs off.
Everything a user needs to run it offline.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from vitserve.deployments.config import VitserveConfig

APP_NAME = "vitserve"
PREFILL_APP_NAME = "vitserve-prefill"
# Ray runs its workers at nice 15 to favour the driver; here the replicas are the work (the
# driver only waits), and at nice 15 every bit of background activity preempted the encoder's
# compute threads: 448px forwards measured ~10% slower in a replica than in-process.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _logging(access_log: bool) -> dict[str, Any]:
    return {"enable_access_log": access_log, "log_level": "WARNING"}


def start_ray(num_cpus: int | None = None) -> None:
    """A new local Ray cluster for this process (unless one is up already)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        # address="local": always a new cluster of this process, never someone else's.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 logging_level="warning", log_to_driver=False,
                 _system_config=LOCAL_SYSTEM_CONFIG)  # fmt: skip


def start_serve(host: str, port: int, *, access_log: bool = False) -> str:
    """Serve's HTTP proxy on ``host:port`` in the running cluster; its base URL."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, logging_config=_logging(access_log))
    return f"http://{host}:{port}"


def serve_app(app: Any, *, name: str = APP_NAME, route_prefix: str = "/",
              access_log: bool = False) -> None:  # fmt: skip
    """Deploy a built application and wait until it is ready."""
    from ray import serve

    serve.run(app, name=name, route_prefix=route_prefix, logging_config=_logging(access_log))


def start_local(cfg: VitserveConfig, *, num_cpus: int | None = None,
                prefill: bool = False) -> str:  # fmt: skip
    """Start local Ray (unless already up), Serve on ``cfg.http_host:cfg.http_port``, and the
    encoder application (``vitserve``, at ``/``); with ``prefill``, the prefill application
    too (``vitserve-prefill``, at ``cfg.prefill.route_prefix``, reaching the encoder
    application by its handle). Returns the base URL once they answer."""
    from vitserve.deployments.app import build_application

    app = build_application(cfg)  # a model that cannot load fails here, before Ray starts
    chat = None
    if prefill:
        from vitserve.deployments.prefill import build_prefill_application

        cfg = cfg.model_copy(update={"prefill": cfg.prefill.model_copy(
            update={"encoder_app": APP_NAME, "encoder_url": None})})  # fmt: skip
        chat = build_prefill_application(cfg)
    start_ray(num_cpus)
    url = start_serve(cfg.http_host, cfg.http_port, access_log=cfg.access_log)
    serve_app(app, access_log=cfg.access_log)
    if chat is not None:
        serve_app(chat, name=PREFILL_APP_NAME, route_prefix=cfg.prefill.route_prefix,
                  access_log=cfg.access_log)  # fmt: skip
    return url


def stop_local() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def local_config(overrides: dict[str, Any]) -> VitserveConfig:
    """The config of a local run: the environment and ``overrides`` over the defaults; port 0
    picks a free port."""
    cfg = VitserveConfig.load(overrides)
    if cfg.http_port == 0:
        cfg = cfg.model_copy(update={"http_port": free_port(cfg.http_host)})
    return cfg
