"""The client SDK's all-cached encode: a probe of the store directly vs through the ingress.

Eight images are encoded once; then ``client.encode`` of the same eight, every one cached, is
timed with a direct-store client (``store=`` the Redis URL: keys computed locally, one store
probe) and with an HTTP-only client (``POST /v1/probe``), ``--reps`` calls each, interleaved
in blocks of ``--block`` (the first call of each block untimed: it warms that path's
connection again), against one in-process application (``client_rig``); p50 and p90.

Invariants:

* Every timed call answers from the store: each handle is ``cached`` and the encoder's own
  counter of images encoded reads the same after the calls as before (the page says so).
* Goals: the direct probe's p50 <= 1 ms, and >= 10x faster than through the ingress.

    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_cached.py \\
        --out loadtest/results/client-cached-cpu.md
    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_cached.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_rig import Encoder, add_common_args, finish, new_client, png, start, verdict

CACHED_SEED = 90_000_000
DIRECT, HTTP = "direct store", "HTTP /v1/probe"


def blocked(fns: dict[str, Callable[[], Any]], reps: int, block: int) -> dict[str, list[float]]:
    """``reps`` timed calls of each function, in alternating blocks of ``block`` calls (A-B-A-B
    ..., the first of each block untimed), so drift hits both."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    while min(map(len, out.values())) < reps:
        for name, fn in fns.items():
            fn()  # the first call after a switch warms this path's connection again
            for _ in range(min(block, reps - len(out[name]))):
                start_s = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - start_s)
    return out


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1]


def all_cached(url: str, encoder: Encoder, args: argparse.Namespace) -> dict[str, Any]:
    direct, _ = new_client(url, args.redis)
    http, _ = new_client(url, None)
    images = [png(args.size, CACHED_SEED + i) for i in range(8)]
    direct.encode(images)
    encoder.delta()

    def run(client: Any) -> Callable[[], None]:
        def call() -> None:
            handles = client.encode(images)
            assert all(h.cached for h in handles)

        return call

    times = blocked({DIRECT: run(direct), HTTP: run(http)}, args.reps, args.block)
    encoded, _ = encoder.delta()
    out: dict[str, Any] = {
        name: {"p50": statistics.median(t) * 1e3, "p90": pct(t, 90) * 1e3, "n": len(t)}
        for name, t in times.items()
    }
    out["encoded"] = encoded
    out["kb"] = sum(map(len, images)) / 1e3
    d, h = out[DIRECT], out[HTTP]
    print(
        f"\n== all-cached encode of 8 images ({out['kb']:.0f} KB), {args.reps} calls each, "
        f"blocks of {args.block}; images encoded meanwhile: {encoded}"
    )
    print(f"{'probe':<16} {'p50 ms':>8} {'p90 ms':>8}")
    for name in (DIRECT, HTTP):
        print(f"{name:<16} {out[name]['p50']:>8.3f} {out[name]['p90']:>8.3f}")
    print(
        f"HTTP / direct: p50 {h['p50'] / d['p50']:.1f}x, p90 {h['p90'] / d['p90']:.1f}x",
        flush=True,
    )
    direct.close()
    http.close()
    return out


def report(cached: dict[str, Any], args: argparse.Namespace) -> str:
    d, h = cached[DIRECT], cached[HTTP]
    ratio = h["p50"] / d["p50"]
    return "\n".join(
        [
            f"## All-cached `encode` of 8 images ({cached['kb']:.0f} KB of PNG), "
            f"{args.reps} calls each, interleaved in blocks of {args.block}",
            "",
            "| probe | p50 ms | p90 ms |",
            "|---|---|---|",
            f'| direct store (`store="{args.redis}"`) | {d["p50"]:.3f} | {d["p90"]:.3f} |',
            f"| through the ingress (`POST /v1/probe`) | {h['p50']:.3f} | {h['p90']:.3f} |",
            f"| ingress / direct | {ratio:.1f}x | {h['p90'] / d['p90']:.1f}x |",
            "",
            f"Images encoded during these calls: {cached['encoded']}.",
            "",
            "## Goals",
            "",
            f"* all-cached 8 images, direct probe p50 <= 1 ms: {d['p50']:.3f} ms "
            f"({verdict(d['p50'] <= 1)}); >= 10x faster than through the ingress: "
            f"{ratio:.1f}x ({verdict(ratio >= 10)})",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="timed calls per side")
    parser.add_argument("--block", type=int, default=20, help="calls per block")
    add_common_args(parser)
    args = parser.parse_args()
    rig = start(args)
    cached = all_cached(rig.url, rig.encoder, args)
    finish(
        rig,
        args,
        "The client SDK: an all-cached encode, probed directly and through the ingress",
        f"; images {args.size}x{args.size} PNG",
        report(cached, args),
    )


if __name__ == "__main__":
    main()
