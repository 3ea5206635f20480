"""Store benchmark: each backend against its raw baseline, measured side by side in one run.

For embeddings of 1, 8 and 32 MiB (fp16 rows of 3584, as a Qwen2.5-VL-7B-sized projector emits):

* in-process and node-local ``get`` vs ``numpy.copyto`` of the same bytes (memcpy bandwidth);
  for the node-local store both a repeated read (the reader keeps what it read) and a first
  read (``read_cache_bytes=0``: one actor round trip and a mapping every time);
* the node-local lookup round trip (``headers_many`` / ``lookup_or_claim`` of one held key);
* Redis ``put``/``get`` vs raw redis-py ``SET``/``GET`` of the same bytes;
* a row-range pull of k of N rows: bytes moved vs the whole record;
* bytes allocated per get (tracemalloc), to show where copies happen.

Every figure is the median of ``--repeat`` timed calls after a warm-up.

    python loadtest/bench_stores.py --redis redis://127.0.0.1:6379/14
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

WIDTH = 3584  # fp16 row: 7 KiB
SIZES_MIB = (1, 8, 32)


def timed(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def allocated(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated (tracemalloc) while ``fn`` runs; its result is kept alive."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        keep = fn()
        _, peak = tracemalloc.get_traced_memory()
        del keep
    finally:
        tracemalloc.stop()
    return peak


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def record_of(mib: int, seed: int) -> Any:
    from vitserve.cache.codec import EmbeddingRecord
    from vitserve.testing.records import new_key

    rows = mib * 2**20 // (WIDTH * 2)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, WIDTH), dtype=np.float32).astype(np.float16)
    return EmbeddingRecord(
        key=new_key(),
        fingerprint="bench",
        dtype="fp16",
        num_tokens=rows,
        grid=None,
        tensors={"embedding": data},
    )


def bench_local(store: Any, label: str, repeat: int) -> None:
    from vitserve.cache.codec import encode_record

    print(f"\n== {label} get vs numpy.copyto of the same bytes")
    print(
        f"{'MiB':>4} {'copyto GB/s':>12} {'get GB/s':>9} {'ratio':>6} {'alloc/get':>10} "
        f"{'get (no checksum)':>18}"
    )
    for mib in SIZES_MIB:
        record = record_of(mib, mib)
        value = encode_record(record)
        store.put_values([(record.key, value)])
        src = record.embedding
        dst = np.empty_like(src)
        t_copy = timed(lambda: np.copyto(dst, src), repeat)  # noqa: B023
        t_get = timed(lambda: store.get(record.key), repeat)  # noqa: B023
        alloc = allocated(lambda: store.get(record.key))  # noqa: B023
        # whether reads check payloads is the connection's setting: off for one measurement
        store.connection.verify_payload = False
        t_raw = timed(lambda: store.get(record.key), repeat)  # noqa: B023
        del store.connection.verify_payload  # back to its class's setting
        n = src.nbytes
        print(
            f"{mib:>4} {gbps(n, t_copy):>12.2f} {gbps(n, t_get):>9.2f} "
            f"{t_copy / t_get:>6.2f} {alloc:>10,} {gbps(n, t_raw):>18.2f}"
        )


def bench_node_lookups(store: Any, repeat: int) -> None:
    """Lookup round trips of one held key (p50 of ``repeat`` x 20 calls)."""
    from vitserve.cache.codec import encode_record

    record = record_of(1, 99)
    store.put_values([(record.key, encode_record(record))])
    print("\n== node-local lookups of one held key (one actor round trip each)")
    for name, fn in (
        ("headers_many", lambda: store.headers_many([record.key])),
        ("lookup_or_claim", lambda: store.lookup_or_claim([record.key], 10)),
        ("exists_many", lambda: store.exists_many([record.key])),
    ):
        print(f"{name:>16}: p50 {timed(fn, repeat * 20) * 1e3:.3f} ms")


def paired(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float, float]:
    """Median seconds of ``a`` and of ``b`` timed alternately, and the median of the per-pair
    ratios ``a / b`` (pairs cancel most of the drift of a busy machine)."""
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(repeat):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratios = [x / y for x, y in zip(ta, tb, strict=True)]
    return statistics.median(ta), statistics.median(tb), statistics.median(ratios)


def bench_redis(url: str, repeat: int) -> None:
    import redis

    from vitserve.cache.codec import encode_record
    from vitserve.cache.redis_store import RedisStore

    raw = redis.Redis.from_url(url)
    store = RedisStore(url, namespace="bench")
    print(
        "\n== Redis: vitserve put/get vs raw redis-py SET/GET of the same bytes "
        "(ratio: median of paired raw/vitserve time ratios; 1.0 = no overhead)"
    )
    print(
        f"{'MiB':>4} {'SET GB/s':>9} {'put GB/s':>9} {'ratio':>6} {'GET GB/s':>9} "
        f"{'get GB/s':>9} {'ratio':>6} {'alloc/GET':>11} {'alloc/get':>11}"
    )
    for mib in SIZES_MIB:
        record = record_of(mib, 100 + mib)
        value = bytes(encode_record(record))  # the same bytes object for both sides
        n = len(value)
        raw_key = f"bench:raw:{record.key}"
        t_set, t_put, r_put = paired(
            lambda: raw.set(raw_key, value),  # noqa: B023
            lambda: store.put_values([(record.key, value)]),  # noqa: B023
            repeat,
        )
        t_get_raw, t_get, r_get = paired(
            lambda: raw.get(raw_key),  # noqa: B023
            lambda: store.get(record.key),  # noqa: B023
            repeat,
        )
        a_raw = allocated(lambda: raw.get(raw_key))  # noqa: B023
        a_get = allocated(lambda: store.get(record.key))  # noqa: B023
        print(
            f"{mib:>4} {gbps(n, t_set):>9.2f} {gbps(n, t_put):>9.2f} {r_put:>6.2f} "
            f"{gbps(n, t_get_raw):>9.2f} {gbps(n, t_get):>9.2f} {r_get:>6.2f} "
            f"{a_raw:>11,} {a_get:>11,}"
        )
        raw.delete(raw_key)
        store.delete(record.key)

    print("\n== Redis row-range pull: k of N rows")
    record = record_of(32, 7)
    store.put_many([record])
    n_rows = record.num_tokens
    whole = store.stats()["bytes_fetched"]
    store.get(record.key)
    whole = store.stats()["bytes_fetched"] - whole
    print(f"{'k':>6} {'N':>6} {'k/N':>7} {'bytes moved':>12} {'moved/whole':>12} {'ms':>7}")
    for k in (16, 256, 1024, n_rows // 2):
        r0 = n_rows // 3
        before = store.stats()["bytes_fetched"]
        t = timed(lambda: store.get_rows(record.key, r0, r0 + k), repeat)  # noqa: B023
        moved = (store.stats()["bytes_fetched"] - before) // (repeat + 1)
        print(
            f"{k:>6} {n_rows:>6} {k / n_rows:>7.3f} {moved:>12,} {moved / whole:>12.3f} "
            f"{t * 1e3:>7.2f}"
        )
    store.delete(record.key)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--skip-node", action="store_true")
    args = parser.parse_args()

    from vitserve.cache.memory import MemoryStore

    bench_local(MemoryStore(), "in-process store", args.repeat)
    if not args.skip_node:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray

        from vitserve.cache.node import NodeStore

        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
        name = "vitserve-bench-node-store"
        bench_local(NodeStore(actor_name=name), "node-local store, repeated read", args.repeat)
        bench_local(
            NodeStore(actor_name=name, read_cache_bytes=0),
            "node-local store, first read (no reader cache)",
            args.repeat,
        )
        bench_node_lookups(NodeStore(actor_name=name), args.repeat)
        ray.shutdown()
    bench_redis(args.redis, args.repeat)


if __name__ == "__main__":
    main()
