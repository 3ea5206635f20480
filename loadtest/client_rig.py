"""The rig the client SDK's benchmarks share: one in-process vitserve application to measure.

Each ``loadtest/bench_client_*.py`` script is one benchmark (multi-turn probe, all-cached
encode, ``fetch_chunk`` bandwidth, TTFT through the prefill route); what they all need lives
here: the service they run against (local Ray, Serve's HTTP proxy, the Redis store at
``--redis``, the random-weight Qwen2-VL ``small`` model: a ViT-B tower, built once into the
cache), the encoder deployment's counters, SDK clients with their own metrics registries, the
turns' PNGs, and the results page's head.

Invariants:

* One benchmark per script: this module measures nothing and prints no figure of its own.
* Every script starts from the same state: the Redis database at ``--redis`` flushed, the
  application started with a namespace of its own (``bench-client-<pid>``), the encoder warmed
  up by three encodes (1, 2, 1 images) whose counters are then zeroed.
* A results page opens with the machine, the load average at the start and the end, the
  command that reruns it (the script's own path and arguments), and the model and store.

ray, torch and the service are imported inside the functions that use them, so a script's
``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.utils import HIREDIS_AVAILABLE

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_hot_path import machine  # noqa: E402

APP = "bench-client"
FAMILY, PRESET = "qwen2_vl", "small"
WARM_SEED = 92_000_000


def png(size: int, seed: int) -> bytes:
    from vitserve.testing.images import make_image

    return make_image(size, size, fmt="PNG", seed=seed)


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every client benchmark takes."""
    parser.add_argument("--size", type=int, default=224, help="side of the turns' images")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        help="the model's dtype (default: the host's, bf16 where native)",
    )
    parser.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/14",
        help="the store (its db is flushed at start)",
    )
    parser.add_argument("--out", help="write the results page (markdown) here")


class Encoder:
    """Deltas of the encoder deployment's counters: images encoded, forward seconds."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.last = self.read()

    def read(self) -> tuple[int, float]:
        c = self.handle.counters.remote().result()
        return int(c["images"]), float(c["seconds"].get("forward_and_encode", 0.0))

    def delta(self) -> tuple[int, float]:
        now = self.read()
        out = (now[0] - self.last[0], now[1] - self.last[1])
        self.last = now
        return out


def new_client(url: str, store: str | None) -> tuple[Any, Any]:
    """An EncoderClient (direct store when ``store``) with its own metrics registry."""
    from prometheus_client import CollectorRegistry

    from vitserve.client import EncoderClient

    registry = CollectorRegistry()
    client = EncoderClient(url, store=store, registry=registry, timeout_s=600)
    client.describe()
    return client, registry


def namespace() -> str:
    return f"bench-client-{os.getpid()}"


def start_app(args: argparse.Namespace, model: str) -> tuple[str, Any]:
    """Local Ray, Serve's proxy on a free port, and the application over the Redis store; the
    base URL and the encoder deployment's handle."""
    from ray import serve

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import free_port, serve_app, start_ray, start_serve

    start_ray(num_cpus=2)
    url = start_serve("127.0.0.1", free_port())
    fields: dict[str, Any] = {"model": model, "store": args.redis, "namespace": namespace()}
    if args.dtype:
        fields["dtype"] = args.dtype
    serve_app(build_application(VitserveConfig.load(fields)), name=APP, route_prefix="/")
    return url, serve.get_deployment_handle("EncoderDeployment", app_name=APP)


@dataclass
class Rig:
    """The running application and what a results page says about it."""

    url: str
    encoder: Encoder
    model: str
    health: dict[str, Any]
    width: int  # an embedding row's width (the model's hidden size)
    redis_info: str
    dtype_how: str
    started: float
    load0: tuple[float, float, float]


def start(args: argparse.Namespace) -> Rig:
    """Flush the store, build the model once, start the application and warm its encoder up."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from vitserve.testing.models import cached_model, is_cached

    started = time.perf_counter()
    load0 = os.getloadavg()
    server = redis.Redis.from_url(args.redis)
    server.flushdb()
    parser_name = "hiredis" if HIREDIS_AVAILABLE else "no hiredis: the pure-Python reply parser"
    redis_info = (
        f"redis-server {server.info('server')['redis_version']}, redis-py "
        f"{redis.__version__} ({parser_name})"
    )
    server.close()
    if not is_cached(FAMILY, PRESET):
        print(f"building the {FAMILY} {PRESET} model once...", flush=True)
    model = str(cached_model(FAMILY, PRESET))
    url, handle = start_app(args, model)
    encoder = Encoder(handle)
    probe, _ = new_client(url, args.redis)
    health = probe.describe()
    # warm-up: the first forwards of a process pay one-off costs (kernels, allocations)
    handles = []
    for n in (1, 2, 1):
        handles = probe.encode([png(args.size, WARM_SEED + 10 * n + i) for i in range(n)])
    probe.close()
    encoder.delta()
    how = "set by --dtype" if args.dtype else "the host default"
    print(
        f"model: {FAMILY} {PRESET} (ViT-B tower, random weights) at {model}, "
        f"{health['dtype']} ({how}) on {health['device']}; store {args.redis} ({redis_info}); "
        f"{os.cpu_count()} CPUs; load average at start "
        f"{load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}",
        flush=True,
    )
    return Rig(
        url=url,
        encoder=encoder,
        model=model,
        health=health,
        width=int(handles[0].shape[1]),
        redis_info=redis_info,
        dtype_how=how,
        started=started,
        load0=load0,
    )


def finish(rig: Rig, args: argparse.Namespace, title: str, setup: str, body: str) -> None:
    """Print the report and, with ``--out``, write it as a results page: ``title``, the
    machine, the load, the command that reruns it, the model and store, ``setup`` (what this
    benchmark adds to the application), then ``body``."""
    load1 = os.getloadavg()
    elapsed = time.perf_counter() - rig.started
    print(
        f"\nrun took {elapsed:.0f} s; load average at the end "
        f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}"
    )
    print("\n" + body)
    if not args.out:
        return
    l0 = rig.load0
    script = Path(sys.argv[0]).resolve().relative_to(HERE.parent)
    head = [
        f"# {title} ({time.strftime('%Y-%m-%d')})",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in machine().items()),
        f"(load average at start {l0[0]:.1f} / {l0[1]:.1f} / {l0[2]:.1f}, at the end "
        f"{load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}; the run took {elapsed:.0f} s)",
        "",
        f"Command: `RAY_AUTH_MODE=disabled .venv/bin/python {script} {' '.join(sys.argv[1:])}`",
        "",
        f"Model: {FAMILY} `{PRESET}` (random weights, a ViT-B tower; embedding rows of "
        f"{rig.width}), {rig.health['dtype']} ({rig.dtype_how}) on {rig.health['device']}. One "
        f"in-process application (local Ray, 2 CPUs; Serve's HTTP proxy; the Redis store "
        f"`{args.redis}`, flushed at start; {rig.redis_info}){setup}.",
        "",
        "",
    ]
    Path(args.out).write_text("\n".join(head) + body)
    print(f"\nwrote {args.out}")
