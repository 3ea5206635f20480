"""The client SDK's ``fetch_chunk`` against a raw redis-py read of the same bytes.

``--fetch-images`` images of ``--fetch-size`` px are encoded into the Redis store of one
in-process application (``client_rig``); then one chunk covering all of them (headers cached
after a warm-up: one round trip) is read by ``client.fetch_chunk`` and by a redis-py pipeline
of ``GETRANGE`` over exactly the byte spans the store reads (``codec.row_spans`` of each
record's header), timed in alternating pairs, ``--reps`` pairs; medians. A diagnostic second
pairing reads with the store's block checksums off.

Invariants:

* Both sides read the same bytes: the raw spans' total equals the store's ``bytes_read`` per
  ``fetch_chunk`` call (the page prints both), and the SDK's rows are every image's rows.
* Goal: ``fetch_chunk`` >= 0.9x the raw pipeline (the median of the pairs' raw / SDK time).

    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_fetch.py \\
        --out loadtest/results/client-fetch-cpu.md
    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_fetch.py --reps 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stores import paired
from client_rig import add_common_args, finish, new_client, png, start, verdict

FETCH_SEED = 91_000_000


def fetch_bandwidth(url: str, args: argparse.Namespace) -> dict[str, Any]:
    from vitserve.cache.codec import read_header, row_spans

    client, _ = new_client(url, args.redis)
    store = client.core.store
    images = [png(args.fetch_size, FETCH_SEED + i) for i in range(args.fetch_images)]
    handles = client.encode(images)
    offsets, pos = [], 0  # back to back, --text-tokens of text before each
    for h in handles:
        pos += args.text_tokens
        offsets.append(pos)
        pos += h.num_tokens
    start_tok, end_tok = offsets[0], offsets[-1] + handles[-1].num_tokens

    raw = redis.Redis.from_url(args.redis)
    ranges = []  # (redis key, first byte, last byte) of every span the store reads
    for h in handles:
        vkey = store.connection._vkey(store.full_key(h.key))  # {prefix}:v:{ns/key}
        header = read_header(raw.get(vkey))
        ranges += [(vkey, sp.start, sp.end - 1) for sp in row_spans(header, 0, h.num_tokens)]
    nbytes = sum(b - a + 1 for _, a, b in ranges)

    def raw_read() -> list[bytes]:
        pipe = raw.pipeline(transaction=False)
        for key, a, b in ranges:
            pipe.getrange(key, a, b)
        return pipe.execute()

    def sdk_read() -> Any:
        return client.fetch_chunk(handles, offsets, start_tok, end_tok)

    chunk = sdk_read()  # warm-up: the headers are cached from here on
    assert chunk.rows == sum(h.num_tokens for h in handles)
    assert sum(map(len, raw_read())) == nbytes
    before = store.stats()["bytes_read"]
    sdk_read()
    per_call = store.stats()["bytes_read"] - before
    t_raw, t_sdk, ratio = paired(raw_read, sdk_read, args.reps)
    # diagnostic: the same read without the block checksums (the connection's setting)
    store.connection.verify_payload = False
    t_raw2, t_nov, ratio_nov = paired(raw_read, sdk_read, args.reps)
    del store.connection.verify_payload  # back to its class's setting
    out = {
        "images": len(handles),
        "rows": chunk.rows,
        "nbytes": nbytes,
        "per_call": per_call,
        "width": handles[0].shape[1],
        "dtype": handles[0].dtype,
        "spans": len(ranges),
        "raw_ms": t_raw * 1e3,
        "sdk_ms": t_sdk * 1e3,
        "ratio": ratio,
        "raw2_ms": t_raw2 * 1e3,
        "nov_ms": t_nov * 1e3,
        "ratio_nov": ratio_nov,
    }
    mb = nbytes / 1e6
    print(
        f"\n== fetch_chunk vs raw redis-py GETRANGE pipeline: {out['images']} images of "
        f"{args.fetch_size}px, {out['rows']} rows x {out['width']} {out['dtype']}, "
        f"{nbytes / 2**20:.2f} MiB in {len(ranges)} spans; store bytes_read per fetch_chunk "
        f"{per_call:,} (raw spans {nbytes:,}); medians of {args.reps} alternating pairs"
    )
    print(f"{'read':<40} {'ms':>8} {'MB/s':>8} {'raw/this':>9}")
    print(f"{'raw pipeline of GETRANGE':<40} {t_raw * 1e3:>8.2f} {mb / t_raw:>8.0f} {'':>9}")
    print(f"{'client.fetch_chunk':<40} {t_sdk * 1e3:>8.2f} {mb / t_sdk:>8.0f} {ratio:>9.2f}")
    print(f"{'raw pipeline (again, paired below)':<40} {t_raw2 * 1e3:>8.2f} {mb / t_raw2:>8.0f}")
    print(
        f"{'fetch_chunk, checksums off (diagnostic)':<40} {t_nov * 1e3:>8.2f} "
        f"{mb / t_nov:>8.0f} {ratio_nov:>9.2f}",
        flush=True,
    )
    raw.close()
    client.close()
    return out


def report(f: dict[str, Any], args: argparse.Namespace) -> str:
    mb = f["nbytes"] / 1e6
    return "\n".join(
        [
            "## `fetch_chunk` vs a raw redis-py pipeline of `GETRANGE` over the same spans",
            "",
            f"{f['images']} images of {args.fetch_size}x{args.fetch_size}, {f['rows']} rows "
            f"x {f['width']} {f['dtype']}: {f['nbytes']:,} bytes in {f['spans']} spans "
            f"({f['nbytes'] / 2**20:.2f} MiB); one chunk covering every image, headers cached "
            f"(the store's `bytes_read` per call: {f['per_call']:,}). Medians of {args.reps} "
            "alternating pairs; ratio = median of the pairs' raw time / SDK time.",
            "",
            "| read | ms | MB/s | raw time / this time |",
            "|---|---|---|---|",
            f"| raw redis-py pipeline of GETRANGE | {f['raw_ms']:.2f} | "
            f"{mb / f['raw_ms'] * 1e3:.0f} | |",
            f"| `client.fetch_chunk` | {f['sdk_ms']:.2f} | {mb / f['sdk_ms'] * 1e3:.0f} | "
            f"{f['ratio']:.2f} |",
            f"| (diagnostic) `fetch_chunk` with the store's block checksums off, paired with "
            f"its own raw run ({f['raw2_ms']:.2f} ms) | {f['nov_ms']:.2f} | "
            f"{mb / f['nov_ms'] * 1e3:.0f} | {f['ratio_nov']:.2f} |",
            "",
            "## Goals",
            "",
            f"* fetch_chunk >= 0.9x a raw GETRANGE pipeline: {f['ratio']:.2f}x "
            f"({verdict(f['ratio'] >= 0.9)})",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="timed pairs")
    parser.add_argument("--fetch-size", type=int, default=448)
    parser.add_argument("--fetch-images", type=int, default=24)
    parser.add_argument(
        "--text-tokens",
        type=int,
        default=8,
        help="text tokens before each image in the chunk's prompt layout",
    )
    add_common_args(parser)
    args = parser.parse_args()
    rig = start(args)
    fetch = fetch_bandwidth(rig.url, args)
    finish(
        rig,
        args,
        "The client SDK: `fetch_chunk` against a raw redis-py read",
        "",
        report(fetch, args),
    )


if __name__ == "__main__":
    main()
