"""Serve's router vs vitserve's on a mixed load, one run: thumbnails beside large images.

One vitserve application at a time (the servers share the cores) with two encoder replicas of
one torch thread each, deployed with ``encoder.routing: serve-default``, then ``work``, then
``serve-default`` again (A-B-A: the two A blocks show the machine's drift), each block for
``--seconds`` after a warm-up. In each block, closed-loop clients send one new image per request
(never seen before, so every request is encoded): ``--thumb-clients`` send ``--thumb-px``
thumbnails, ``--large-clients`` send ``--large-px`` images. A new image is a JPEG made once per
kind with a unique comment segment (``loadtest.harness.scenarios.tag_jpeg``): new bytes and key,
the same pixels, and no image made while the servers share the cores with the clients. Per
block: each kind's p50 and p99 latency, the images and patches answered per second, and the
refusals (429) and failures. A large image takes seconds here, so a block must be long enough
for many of them: patches/s counts an image when it is answered.

The figures the issue asks for (thumbnail p99 of vitserve's router <= 0.5x Serve's, overall
throughput >= 1.0x) are printed against the mean of the two Serve blocks; ``--out`` writes the
results page::

    RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock \\
        python loadtest/bench_routing.py --out loadtest/results/routing-cpu.md
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine
from loadtest.harness.scenarios import make_jpeg, tag_jpeg

#: The routers compared, in order (A-B-A: the two A blocks show the machine's drift).
ROUTINGS = ("serve-default", "work", "serve-default")
_tags = itertools.count()


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank; NaN when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@dataclass
class Block:
    routing: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"thumb": [], "large": []})
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    images: int = 0
    patches: int = 0
    seconds: float = 0.0

    def p(self, kind: str, q: float) -> float:
        return quantile(self.latencies[kind], q)


def deploy(
    routing: str, args: argparse.Namespace, model: str, ingress_replicas: int = 1
) -> tuple[str, Any]:
    """A vitserve application with two encoder replicas of one torch thread each on
    ``routing``, under a new name (and namespace: nothing cached from another block)."""

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import serve_app

    name = f"route-{routing}-{time.time_ns()}"
    cfg = VitserveConfig.load(
        {
            "model": model,
            "namespace": name,
            "torch_threads": 1,
            "encoder": {"num_replicas": 2, "num_cpus": 0.5, "routing": routing},
            "ingress": {"num_replicas": ingress_replicas, "num_cpus": 0.25},
        }
    )
    serve_app(build_application(cfg), name=name, route_prefix=f"/{name}")
    return name, cfg


def abab(
    args: argparse.Namespace,
    run: Callable[[str, str, str], Any],
    row: Callable[[int, Any], str],
    ingress_replicas: int = 1,
) -> list[Any]:
    """Start Ray and Serve here, then per router of :data:`ROUTINGS`, one application at a time:
    deploy it, ``run(url, app name, routing)``, print ``row(block number, result)``, delete it;
    the runs' results in order."""
    from ray import serve

    from vitserve.deployments.common.serving import resolve_model
    from vitserve.deployments.runner.local import free_port, start_ray, start_serve

    model = resolve_model("demo")
    start_ray(num_cpus=4)  # logical CPUs: one application's replicas at a time
    base = start_serve("127.0.0.1", free_port())
    results = []
    for routing in ROUTINGS:
        name, _ = deploy(routing, args, model, ingress_replicas)
        results.append(run(f"{base}/{name}", name, routing))
        print(row(len(results), results[-1]), flush=True)
        serve.delete(name)
    return results


def write_page(lines: list[str], out: Path | None) -> None:
    print("\n".join(lines))
    if out:
        out.write_text("\n".join(lines))


def run_block(url: str, app: str, routing: str, args: argparse.Namespace) -> Block:
    from ray import serve

    from vitserve.deployments.encoder.admission import image_work
    from vitserve.encoder.images import ImageLimits

    handle = serve.get_deployment_handle("EncoderDeployment", app_name=app)
    rule = handle.work_terms.remote().result().rule
    block = Block(routing)
    lock = threading.Lock()
    stop = threading.Event()
    measuring = threading.Event()
    base = {"thumb": make_jpeg(args.thumb_px, args.thumb_px, seed=1)}
    base["large"] = make_jpeg(args.large_px, args.large_px, seed=2)
    patches = {
        kind: image_work(rule, data, 0, ImageLimits()).patches for kind, data in base.items()
    }

    def client(kind: str) -> None:
        with httpx.Client(timeout=600) as c:
            while not stop.is_set():
                data = tag_jpeg(base[kind], f"bench-routing {app} {next(_tags)}")
                started = time.perf_counter()
                try:
                    r = c.post(
                        f"{url}/v1/encode", files=[("images", ("i.jpg", data, "image/jpeg"))]
                    )
                    status: int | str = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                took = time.perf_counter() - started
                if not measuring.is_set():
                    continue
                with lock:
                    if status == 200:
                        block.latencies[kind].append(took)
                        block.images += 1
                        block.patches += patches[kind]
                    elif isinstance(status, int):
                        block.statuses[status] = block.statuses.get(status, 0) + 1
                    else:
                        block.failures.append(status)

    threads = [
        threading.Thread(target=client, args=(kind,), daemon=True)
        for kind, n in (("thumb", args.thumb_clients), ("large", args.large_clients))
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    measuring.set()
    started = time.perf_counter()
    time.sleep(args.seconds)
    measuring.clear()
    block.seconds = time.perf_counter() - started
    stop.set()
    for t in threads:
        t.join(timeout=600)
    return block


def table(blocks: list[Block], args: argparse.Namespace) -> list[str]:
    lines = [
        "| block | router | thumbnails p50 / p99 (ms) | large p50 / p99 (ms) | images/s | "
        "patches/s | 429 | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return lines + [row(i, b) for i, b in enumerate(blocks, 1)]


def row(i: int, b: Block) -> str:
    refused = b.statuses.get(429, 0)
    other = sum(n for s, n in b.statuses.items() if s != 429) + len(b.failures)
    return (
        f"| {i} | {b.routing} | {b.p('thumb', 0.5) * 1e3:.0f} / {b.p('thumb', 0.99) * 1e3:.0f} "
        f"| {b.p('large', 0.5) * 1e3:.0f} / {b.p('large', 0.99) * 1e3:.0f} "
        f"| {b.images / b.seconds:.2f} | {b.patches / b.seconds:,.0f} | {refused} | {other} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="measured, per block")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--thumb-clients", type=int, default=3)
    parser.add_argument("--large-clients", type=int, default=1)
    parser.add_argument("--thumb-px", type=int, default=112)
    parser.add_argument("--large-px", type=int, default=1344)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    blocks = abab(args, lambda url, app, routing: run_block(url, app, routing, args), row)
    a = [b for b in blocks if b.routing == "serve-default"]
    ours = next(b for b in blocks if b.routing == "work")
    thumb_p99 = ours.p("thumb", 0.99) / statistics.mean(b.p("thumb", 0.99) for b in a)
    tput = (ours.patches / ours.seconds) / statistics.mean(b.patches / b.seconds for b in a)
    verdict = [
        f"Thumbnail p99, vitserve's router / Serve's (mean of its two blocks): "
        f"**{thumb_p99:.2f}x** (target <= 0.5: {'met' if thumb_p99 <= 0.5 else 'missed'}).",
        f"Throughput (patches/s), vitserve's router / Serve's: **{tput:.3f}x** "
        f"(target >= 1.0: {'met' if tput >= 1.0 else 'missed'}).",
    ]
    lines = [
        "# Routing: Serve's router vs vitserve's, a mixed load (CPU)",
        "",
        f"Machine: {'; '.join(f'{k}: {v}' for k, v in machine().items())}; torch "
        f"{torch.__version__}. Model: the demo model "
        "(Qwen2-VL, small tower). Two encoder replicas of one torch "
        "thread each (`encoder.num_cpus` 0.5), the ingress and the node store beside them.",
        "",
        f"Command: `python loadtest/bench_routing.py {' '.join(sys.argv[1:])}`",
        "",
        f"Blocks in order, one application at a time, each {args.seconds:g} s measured after a "
        f"{args.warmup:g} s warm-up: {args.thumb_clients} closed-loop clients sending a new "
        f"{args.thumb_px}x{args.thumb_px} thumbnail per request, {args.large_clients} sending a "
        f"new {args.large_px}x{args.large_px} image per request (every image new: each request "
        "is encoded).",
        "",
        *table(blocks, args),
        "",
        *verdict,
        "",
    ]
    write_page(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
