"""The store alone on a Redis Cluster of 1 and of 3 primaries, on this machine, side by side.

Each client process runs vitserve's store traffic for one new image as fast as it can, over
its own store (``redis+cluster://``): ``lookup_or_claim`` of its key (a miss, claimed), the
publish of its record with the claim released (``put_values(..., release=...)``), then two
row-range reads of half the rows each (what a prefill's chunks pull). Blocks alternate between
the clusters (1, 3, 1, 3, ... shards: both are up the whole run, only one is loaded at a time),
for each record size in turn, and per block the images per second, the servers' CPU per image
(their ``used_cpu_*``) and the clients' CPU per image (their own process times) are kept; the
page shows each cluster's medians, the ratio, and :mod:`loadtest.capacity_model`'s prediction
of it from those CPU costs and this host's cores. The two sizes give the capacity model the
servers' CPU per operation and per byte::

    python loadtest/bench_shards.py --out loadtest/results/shards-cpu.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine
from loadtest.capacity_model import StoreCosts, store_throughput

POOL = 32  # records each client encodes before its window, published again per namespace


def _client(url: str, rows: int, width: int, seconds: float, seed: int, go: Any, out: Any) -> None:
    """One client process: new images' store traffic for ``seconds`` after the barrier ``go``;
    puts (images, CPU seconds). Its records are encoded before (the encoder's work, not the
    store's): a namespace per pass over them makes every key new again."""
    from vitserve.cache import open_connection
    from vitserve.cache.base import Claim, EmbeddingStore, StorePolicy
    from vitserve.cache.codec import encode_record
    from vitserve.testing.records import make_record

    connection, _ = open_connection(url)
    values = [
        (r.key, encode_record(r))
        for r in (
            make_record(rows=rows, width=width, dtype="fp16", seed=seed * POOL + i)
            for i in range(POOL)
        )
    ]
    half, base = rows // 2, uuid.uuid4().hex[:8]
    go.wait()
    until = time.monotonic() + seconds
    started = os.times()
    done = 0
    while time.monotonic() < until:
        key, value = values[done % POOL]
        store = EmbeddingStore(connection, StorePolicy(namespace=f"{base}-{done // POOL}"))
        [claim] = store.lookup_or_claim([key], 30.0)
        assert claim is Claim.WON, claim
        store.put_values([(key, value)], release=[(key, store.token)])
        parts = store.get_rows_many([(key, 0, half), (key, half, rows)])
        assert all(p is not None for p in parts)
        done += 1
    ended = os.times()
    connection.close()
    out.put((done, (ended.user - started.user) + (ended.system - started.system)))


def _server_cpu(cluster: Any) -> float:
    """CPU seconds the cluster's primaries have used so far."""
    total = 0.0
    for node in cluster.primaries():
        cpu = cluster.info(node, "cpu")
        total += float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return total


def block(cluster: Any, clients: int, seconds: float, rows: int, width: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Barrier(clients + 1)
    procs = [
        ctx.Process(target=_client, args=(cluster.url, rows, width, seconds, i, go, out))
        for i in range(clients)
    ]
    for p in procs:
        p.start()
    go.wait(timeout=300)  # every client ready: the window starts
    server_before = _server_cpu(cluster)
    results = [out.get(timeout=seconds + 120) for _ in procs]
    server = _server_cpu(cluster) - server_before
    for p in procs:
        p.join()
    images = sum(n for n, _ in results)
    client_cpu = sum(c for _, c in results)
    return {
        "images_per_s": images / seconds,
        "server_ms": server / images * 1e3,
        "client_ms": client_cpu / images * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--seconds", type=float, default=20.0, help="per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per cluster and size")
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["256x3584", "16x256"],
        help="records as ROWSxWIDTH (fp16): a 448px image's 256 tokens of a 7B-sized model's "
        "3584, and a small record (the per-operation cost)",
    )
    parser.add_argument("--maxmemory-mib", type=int, default=512, help="per primary")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from tests.redis_process import RedisClusterServers  # the suite's local cluster launcher

    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes]
    # a cache, as in production: each primary's maxmemory with LRU eviction (unbounded, the
    # primaries grew by gigabytes a block and slowed block after block)
    memory = ("--maxmemory", f"{args.maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru")
    clusters = {n: RedisClusterServers(masters=n, replicas=0, args=memory) for n in (1, 3)}
    runs: dict[tuple[int, int, int], list[dict[str, float]]] = {}
    try:
        for rows, width in sizes:
            for _ in range(args.blocks):
                for n, cluster in clusters.items():
                    result = block(cluster, args.clients, args.seconds, rows, width)
                    runs.setdefault((rows, width, n), []).append(result)
                    print(rows, width, n, result, flush=True)
    finally:
        for cluster in clusters.values():
            cluster.close()
    cores = os.cpu_count() or 1
    med = {
        run: {k: statistics.median(r[k] for r in results) for k in results[0]}
        for run, results in runs.items()
    }
    lines = [
        "# The store alone on 1 vs 3 Redis Cluster shards (CPU)",
        "",
        f"Machine: {'; '.join(f'{k}: {v}' for k, v in machine().items())}",
        "",
        f"Command: `python loadtest/bench_shards.py {' '.join(sys.argv[1:])}`",
        "",
        "Per image: `lookup_or_claim` of a new key, the publish of its record (fp16 rows) with "
        f"its claim released, two row-range reads of half the rows each. {args.clients} client "
        f"processes, {args.blocks} blocks of {args.seconds:.0f} s per cluster and record size, "
        "the clusters alternating (1, 3, 1, 3, ...); medians of the blocks. Local clusters of "
        f"redis-server 7 primaries without replicas, maxmemory {args.maxmemory_mib} MiB each "
        f"(allkeys-lru), on loopback, sharing this host's {cores} cores with the clients. "
        "Predicted: `loadtest/capacity_model.py` from the 1-primary run's CPU costs and this "
        "host's cores (each primary one core, each client one core, all within the host's).",
        "",
        "| record | primaries | images/s | server CPU per image (ms) | client CPU per image (ms) "
        "| predicted images/s |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for rows, width in sizes:
        one = med[(rows, width, 1)]
        costs = StoreCosts(server_ms=one["server_ms"], client_ms=one["client_ms"])
        predicted = {
            n: store_throughput(costs, shards=n, clients=args.clients, cores=cores) for n in (1, 3)
        }
        for n in (1, 3):
            m = med[(rows, width, n)]
            lines.append(
                f"| {rows}x{width} ({rows * width * 2 / 1024:,.0f} KiB) | {n} | "
                f"{m['images_per_s']:.1f} | {m['server_ms']:.2f} | {m['client_ms']:.2f} | "
                f"{predicted[n]:.1f} |"
            )
        measured = med[(rows, width, 3)]["images_per_s"] / one["images_per_s"]
        ratios.append(
            f"{rows}x{width}: **{measured:.2f}x** measured, {predicted[3] / predicted[1]:.2f}x "
            "predicted"
        )
    lines += [
        "",
        "3 / 1 primaries: " + "; ".join(ratios) + ".",
        "",
        "Blocks (images/s): "
        + "; ".join(
            f"{rows}x{width}, {n} primar{'y' if n == 1 else 'ies'}: "
            + ", ".join(f"{r['images_per_s']:.1f}" for r in results)
            for (rows, width, n), results in runs.items()
        ),
        "",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
