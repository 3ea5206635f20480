"""Serve's router vs vitserve's on a load with 30% repeated images: duplicate encodes, store
hits and where in-flight repeats met their flight, one run.

The same applications as ``bench_routing.py`` (two encoder replicas of one torch thread each),
but with **two ingress replicas**: repeats of an image in flight on the same ingress are joined
there whatever the router does, so only repeats that arrive through the other ingress reach an
encoder replica while the image is in flight, and the router decides whether that is the
replica encoding it (a *local* join: its flight's future) or the other one (a *remote* join:
it waits for the first replica's claim and reads the published embedding from the store).
Blocks in order: ``serve-default``, ``work``, ``serve-default`` (A-B-A), each ``--seconds`` after
a warm-up, one application at a time.

Load: ``--clients`` closed-loop clients, one image per request (112px or 224px JPEGs, every new
image different bytes: ``loadtest.harness.scenarios.ImagePool``); with probability
``--repeat`` the image is instead one of the ``--recent`` images sent last by any client (so
some repeats find their image published, some still in flight). Per block, from the clients and
the replicas' own counters (exact, by handle):

* **duplicate encodes**: images run through the tower minus the distinct images sent (0 is
  single flight holding across ingresses and replicas);
* **store hits**: the ingresses' lookups that found the embedding (repeats of published
  images), as a share of the repeats sent;
* **joins** by where they met the flight: ingress, encoder replica (local), another replica's
  claim (remote);
* latency p50 / p99 of new images and of repeats::

    RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock \\
        python loadtest/bench_repeats.py --out loadtest/results/repeats-cpu.md
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine
from loadtest.bench_routing import abab, quantile, write_page
from loadtest.harness.scenarios import ImagePool

SIZES = ((112, 112), (224, 224))
JOIN_SCOPES = ("ingress", "local", "remote")


@dataclass
class Block:
    routing: str
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"new": [], "repeat": []})
    sent: set[bytes] = field(default_factory=set)  # every distinct image sent, measured or not
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)

    def p(self, kind: str, q: float) -> float:
        return quantile(self.latencies[kind], q)

    @property
    def repeats(self) -> int:
        return self.counters.get("repeats_sent", 0)


def counters(app: str, replicas: int = 2) -> dict[str, float]:
    """The application's counters, exact (each process's own tally, not /metrics' export):
    every ingress replica's and every encoder replica's, by handle calls until each answered."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app_name=app)
    ingress: dict[str, Any] = {}
    encoder: dict[str, Any] = {}
    for _ in range(50):
        for call in [handle.counts.remote() for _ in range(8)]:
            answer = call.result()
            ingress[answer["ingress"]["replica"]] = answer["ingress"]["counts"]
            encoder[answer["encoder"]["replica"]] = answer["encoder"]["counts"]
        if len(ingress) == len(encoder) == replicas:
            break
    else:
        raise RuntimeError(f"{len(ingress)} ingress and {len(encoder)} encoder replicas answered")
    out = {
        "encoded": sum(c.value("images_encoded_total") for c in encoder.values()),
        "hits": sum(c.value("cache_hits_total") for c in ingress.values()),
        "misses": sum(c.value("cache_misses_total") for c in ingress.values()),
        "joins_ingress": sum(c.value("single_flight_joins_total") for c in ingress.values()),
    }
    for scope in ("local", "remote"):
        out[f"joins_{scope}"] = sum(
            c.value("single_flight_joins_total", scope=scope) for c in encoder.values()
        )
    return out


def run_block(url: str, app: str, routing: str, args: argparse.Namespace) -> Block:
    """Load the application from a standing start; its counters cover the whole block (warm-up
    included), its latencies the measured part."""
    block = Block(routing)
    pool = ImagePool(sizes=SIZES, per_size=2, seed=7, run_id=app)
    recent: deque[bytes] = deque(maxlen=args.recent)
    lock = threading.Lock()
    stop, measuring = threading.Event(), threading.Event()
    repeats_sent = 0

    def client(seed: int) -> None:
        nonlocal repeats_sent
        rng = random.Random(seed)
        with httpx.Client(timeout=600) as c:
            while not stop.is_set():
                with lock:
                    repeat = bool(recent) and rng.random() < args.repeat
                    data = rng.choice(list(recent)) if repeat else pool.new(rng)[1]
                    if repeat:
                        repeats_sent += 1
                    else:
                        recent.append(data)
                    block.sent.add(data)
                started = time.perf_counter()
                try:
                    r = c.post(
                        f"{url}/v1/encode", files=[("images", ("i.jpg", data, "image/jpeg"))]
                    )
                    status: int | str = r.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                took = time.perf_counter() - started
                with lock:
                    if status != 200:
                        block.failures.append(str(status))
                    elif measuring.is_set():
                        block.latencies["repeat" if repeat else "new"].append(took)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
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
    block.counters = counters(app) | {"repeats_sent": repeats_sent}
    return block


def table(blocks: list[Block]) -> list[str]:
    lines = [
        "| block | router | requests | distinct images | repeats | encodes | duplicate "
        "encodes | store hits / repeats | joins: ingress / local / remote | new p50 / p99 (ms) "
        "| repeat p50 / p99 (ms) | failures |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [row(i, b) for i, b in enumerate(blocks, 1)]


def row(i: int, b: Block) -> str:
    c = b.counters
    requests = c["hits"] + c["misses"]
    joins = " / ".join(f"{c[f'joins_{s}']:.0f}" for s in JOIN_SCOPES)
    return (
        f"| {i} | {b.routing} | {requests:.0f} | {len(b.sent)} | {b.repeats} "
        f"| {c['encoded']:.0f} | {c['encoded'] - len(b.sent):.0f} "
        f"| {c['hits'] / max(b.repeats, 1):.1%} | {joins} "
        f"| {b.p('new', 0.5) * 1e3:.0f} / {b.p('new', 0.99) * 1e3:.0f} "
        f"| {b.p('repeat', 0.5) * 1e3:.0f} / {b.p('repeat', 0.99) * 1e3:.0f} "
        f"| {len(b.failures)} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured, per block")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeat", type=float, default=0.3, help="share of repeated images")
    parser.add_argument("--recent", type=int, default=8, help="repeats come from the last N")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    blocks = abab(
        args, lambda url, app, routing: run_block(url, app, routing, args), row, ingress_replicas=2
    )
    lines = [
        "# Routing: Serve's router vs vitserve's, 30% repeated images (CPU)",
        "",
        f"Machine: {'; '.join(f'{k}: {v}' for k, v in machine().items())}; torch "
        f"{torch.__version__}. Model: the demo model (Qwen2-VL, small tower). Two encoder "
        "replicas of one torch thread each, two ingress replicas, the node store beside them.",
        "",
        f"Command: `python loadtest/bench_repeats.py {' '.join(sys.argv[1:])}`",
        "",
        f"Blocks in order, one application at a time, each {args.seconds:g} s measured after a "
        f"{args.warmup:g} s warm-up: {args.clients} closed-loop clients, one image per request "
        f"({' or '.join(f'{w}x{h}' for w, h in SIZES)}); each image is, with probability "
        f"{args.repeat:g}, one of the {args.recent} images sent last, else a new one. Counters "
        "(encodes, store hits, joins) cover the whole block, warm-up included; latencies the "
        "measured part. Duplicate encodes = encodes - distinct images sent. A store hit is a "
        "repeat whose embedding was published when it arrived; the other repeats met their "
        "image in flight: joined on their ingress, on the encoder replica encoding it (local), "
        "or through its claim from the other replica (remote: a wait on the store).",
        "",
        *table(blocks),
        "",
    ]
    write_page(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
