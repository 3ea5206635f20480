"""The client SDK's multi-turn probe: per-image keys keep an agent's encoder time flat.

Turns 1..``--turns``; each turn sends the whole conversation's images again plus one new one,
under three strategies, each with its own fresh images (distinct seeds), interleaved turn by
turn (their order rotates each turn), against one in-process application (``client_rig``):

* *per-image keys (vitserve)*: ``client.encode(all images so far)`` with a direct-store client:
  keys computed locally, one store probe, only the new image uploaded and encoded;
* *one key for the whole image set* (a prefix / request-level cache keyed on the set): the
  set's key is blake3 of the concatenation of its images' bytes, and each image is sent with
  that key in a PNG ``tEXt`` chunk, so its content key belongs to this set only: the set's
  first sight (every turn, since the set grows) uploads and encodes every image, and its
  entries are stored under the set (reused only by the same set again);
* *no cache*: before each turn's ``encode`` the conversation's keys are deleted from the store
  (not timed), so every image of every turn is uploaded and encoded.

Per turn: bytes uploaded (the SDK's ``vitserve_client_bytes_uploaded_total``), images encoded
and the encoder's forward time (deltas of the encoder deployment's ``counters()``: ``images``
and ``seconds["forward_and_encode"]``), the end-to-end ``encode`` time, and the fetch time of
the whole prompt's image rows (images back to back with ``--text-tokens`` text tokens before
each and at the end, ``fetch_chunk`` per ``--chunk``-token chunk, summed).

Invariants:

* The three strategies see the same turns through the same service; only the keys differ.
* The goal is read from the encoder's own counters, never from the client's timings: per-image
  keys, encoder time turn N / turn 1 <= 1.2.

    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_turns.py \\
        --out loadtest/results/client-turns-cpu.md
    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_turns.py --turns 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_rig import Encoder, add_common_args, finish, new_client, png, start, verdict

STRATEGIES = ("per-image keys (vitserve)", "one key for the whole image set", "no cache")
SEED_BASE = {s: 10_000_000 * (i + 1) for i, s in enumerate(STRATEGIES)}
SET_TAG = b"vitserve-bench-image-set"
TURN_HEAD = (
    "| turn | images | bytes uploaded | images encoded | encoder ms "
    "| encode ms (end to end) | fetch ms |"
)
TOTALS_HEAD = (
    "| strategy | encoder time | end-to-end encode | fetch | images encoded "
    "| encoder ms per image encoded, turn 1 / last | images encoded (all turns) "
    "| bytes uploaded (all turns) |"
)


def tagged(data: bytes, set_key: str) -> bytes:
    """The PNG with a ``tEXt`` chunk naming its image set, just before ``IEND`` (the pixels,
    and so the embedding, are unchanged; the bytes, and so the content key, are the set's)."""
    from vitserve.testing.images import _png_chunk

    iend = _png_chunk(b"IEND", b"")
    assert data.endswith(iend), "not a PNG ending in IEND"
    text = _png_chunk(b"tEXt", SET_TAG + b"\0" + set_key.encode())
    return data[: -len(iend)] + text + iend


def set_key(images: list[bytes]) -> str:
    return blake3.blake3(b"".join(images)).hexdigest()


def uploaded(registry: Any) -> float:
    return registry.get_sample_value("vitserve_client_bytes_uploaded_total") or 0.0


def layout(handles: list[Any], text_tokens: int) -> tuple[list[int], int]:
    """Prompt offsets of the images laid out back to back, ``text_tokens`` before each and at
    the end; the prompt's length."""
    offsets, pos = [], 0
    for h in handles:
        pos += text_tokens
        offsets.append(pos)
        pos += h.num_tokens
    return offsets, pos + text_tokens


def fetch_prompt(client: Any, handles: list[Any], text_tokens: int, chunk: int) -> float:
    """Seconds to fetch the prompt's image rows, chunk by chunk (sequential, no prefetch)."""
    from vitserve.client import chunk_bounds

    offsets, length = layout(handles, text_tokens)
    start_s = time.perf_counter()
    rows = 0
    for s, e in chunk_bounds(length, chunk):
        rows += client.fetch_chunk(handles, offsets, s, e).rows
    elapsed = time.perf_counter() - start_s
    assert rows == sum(h.num_tokens for h in handles), (rows, handles)
    return elapsed


def multi_turn(url: str, encoder: Encoder, args: argparse.Namespace) -> dict[str, list[dict]]:
    clients = {s: new_client(url, args.redis) for s in STRATEGIES}
    images = {s: [png(args.size, SEED_BASE[s] + t) for t in range(args.turns)] for s in STRATEGIES}
    rows: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    kb = statistics.mean(map(len, images[STRATEGIES[0]])) / 1e3
    print(
        f"\n== multi-turn probe: {args.turns} turns, {args.size}x{args.size} PNGs "
        f"(~{kb:.0f} KB each)"
    )
    print(
        f"{'strategy':<34} {'turn':>4} {'imgs':>4} {'uploaded KB':>11} {'encoded':>7} "
        f"{'encoder ms':>10} {'encode ms':>9} {'fetch ms':>8}",
        flush=True,
    )
    for turn in range(1, args.turns + 1):
        order = STRATEGIES[turn % 3 :] + STRATEGIES[: turn % 3]  # rotate who goes first
        for strategy in order:
            client, registry = clients[strategy]
            convo = images[strategy][:turn]
            send = convo
            if strategy == STRATEGIES[1]:
                key = set_key(convo)
                send = [tagged(b, key) for b in convo]
            elif strategy == STRATEGIES[2]:
                client.core.store.delete(client.core.keys_of(convo))
            before = uploaded(registry)
            encoder.delta()
            start_s = time.perf_counter()
            handles = client.encode(send)
            e2e = time.perf_counter() - start_s
            n_encoded, forward_s = encoder.delta()
            fetch_s = fetch_prompt(client, handles, args.text_tokens, args.chunk)
            row = {
                "turn": turn,
                "images": len(convo),
                "uploaded": uploaded(registry) - before,
                "encoded": n_encoded,
                "encoder_ms": forward_s * 1e3,
                "encode_ms": e2e * 1e3,
                "fetch_ms": fetch_s * 1e3,
            }
            rows[strategy].append(row)
            print(
                f"{strategy:<34} {turn:>4} {row['images']:>4} {row['uploaded'] / 1e3:>11.1f} "
                f"{n_encoded:>7} {row['encoder_ms']:>10.1f} {row['encode_ms']:>9.1f} "
                f"{row['fetch_ms']:>8.2f}",
                flush=True,
            )
    for client, _ in clients.values():
        client.close()
    return rows


def turn_ratios(rows: list[dict], key: str) -> tuple[float, float]:
    """Last turn / first turn of ``key``, and the mean of the last (up to) 4 turns over the
    mean of the first (up to) 4 (a steadier reading on a noisy machine)."""
    k = min(4, len(rows))
    first, last = rows[0][key], rows[-1][key]
    head = statistics.mean(r[key] for r in rows[:k])
    tail = statistics.mean(r[key] for r in rows[-k:])
    return last / first if first else float("nan"), tail / head if head else float("nan")


def report(turns: dict[str, list[dict]], n: int) -> str:
    lines = [
        f"## Multi-turn probe: turns 1..{n}, each re-sending the conversation's images "
        "plus one new one",
        "",
    ]
    for strategy, rows in turns.items():
        lines += [f"**{strategy}**", "", TURN_HEAD, "|---" * 7 + "|"]
        lines += [
            f"| {r['turn']} | {r['images']} | {r['uploaded']:,.0f} | {r['encoded']} | "
            f"{r['encoder_ms']:.1f} | {r['encode_ms']:.1f} | {r['fetch_ms']:.2f} |"
            for r in rows
        ]
        lines.append("")
    lines += [
        f"Turn {n} / turn 1 (in brackets: the mean of the last 4 turns / the mean of the "
        "first 4), and the conversation's totals:",
        "",
        TOTALS_HEAD,
        "|---" * 8 + "|",
    ]
    for strategy, rows in turns.items():
        cells = []
        for key in ("encoder_ms", "encode_ms", "fetch_ms"):
            last, tail = turn_ratios(rows, key)
            cells.append(f"{last:.2f}x ({tail:.2f}x)")
        first, last = rows[0], rows[-1]
        cells.append(f"{last['encoded'] / max(first['encoded'], 1):.0f}x")
        per = [
            r["encoder_ms"] / r["encoded"] if r["encoded"] else float("nan") for r in (first, last)
        ]
        cells.append(f"{per[0]:.1f} / {per[1]:.1f}")
        lines.append(
            f"| {strategy} | {' | '.join(cells)} | {sum(r['encoded'] for r in rows)} "
            f"| {sum(r['uploaded'] for r in rows):,.0f} |"
        )
    r_per = turn_ratios(turns[STRATEGIES[0]], "encoder_ms")[0]
    r_whole = turn_ratios(turns[STRATEGIES[1]], "encoder_ms")[0]
    lines += [
        "",
        "## Goals",
        "",
        f"* per-image keys, encoder time turn {n} / turn 1 <= 1.2: {r_per:.2f}x "
        f"({verdict(r_per <= 1.2)}); the whole-set key, for comparison (~{n}x expected): "
        f"{r_whole:.1f}x",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument(
        "--text-tokens",
        type=int,
        default=8,
        help="text tokens before each image and at the end of the prompt",
    )
    parser.add_argument("--chunk", type=int, default=512, help="fetch chunk (tokens)")
    add_common_args(parser)
    args = parser.parse_args()
    rig = start(args)
    turns = multi_turn(rig.url, rig.encoder, args)
    finish(
        rig,
        args,
        "The client SDK in the multi-turn agent scenario",
        f"; turns' images {args.size}x{args.size} PNG",
        report(turns, args.turns),
    )


if __name__ == "__main__":
    main()
