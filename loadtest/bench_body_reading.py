"""How long reading one large request body holds up everything else in the ingress process.

The ingress gathers a body on its event loop and parses it in two threads of its own. What
holds up the event loop (``/healthz``, every other request) is, for the gathering, the longest
single call the loop itself makes; for the parsing, the longest the parsing thread keeps the
loop from the interpreter lock: a C call that holds it for 100 ms stops the loop for 100 ms,
whichever thread makes it. For a 64 MiB ``/v1/encode`` JSON body (64 images of 1 MiB of base64),
each step the way the ingress did it before issue 25 and the way ``deployments/common/requests.py``
does it now, side by side in one run (median of ``--repeat``):

* gathering the body (on the loop, as its 64 KiB chunks arrive): keeping the chunks and one
  ``b"".join`` at the end, vs one buffer extended by each chunk; *longest call* is the join,
  vs the slowest single extend;
* counting its JSON values (a reader thread): ``bytes.count`` over the whole body, vs in
  ``SCAN_STEP`` steps;
* reading its items (a reader thread): ``json.loads`` of the whole and ``encode_json``, vs
  ``encode_json_bytes`` (item by item).

For the two reader-thread steps, the step runs in a worker thread while the main thread wakes
every millisecond: *longest stall* is the longest gap between its wake-ups.

    .venv/bin/python loadtest/bench_body_reading.py --out loadtest/results/body-reading-cpu.md
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from vitserve.deployments.common import requests as parse
from vitserve.encoder.device import cpu_model

CHUNK = 64 * 2**10
IMAGES = 64


def longest_stall(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(seconds fn took, longest gap between the main thread's 1 ms wake-ups meanwhile)``."""
    done = threading.Event()
    took = [0.0]

    def work() -> None:
        started = time.perf_counter()
        fn()
        took[0] = time.perf_counter() - started
        done.set()

    worker = threading.Thread(target=work)
    last, gap = time.perf_counter(), 0.0
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    worker.join()
    return took[0], gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    junk = [base64.b64encode(rng.bytes(3 * 2**18 - 64)).decode() for _ in range(IMAGES)]
    body = json.dumps({"images": [{"data": j} for j in junk]}).encode()
    chunks = [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]
    allowed = parse.json_values_allowed(IMAGES)

    def longest_call(calls: Callable[[], Any]) -> Callable[[], tuple[float, float]]:
        """A gathering: ``(seconds in all, longest single call)``."""

        def run() -> tuple[float, float]:
            started, longest = time.perf_counter(), 0.0
            for call in calls():
                t = time.perf_counter()
                call()
                longest = max(longest, time.perf_counter() - t)
            return time.perf_counter() - started, longest

        return run

    def join_at_end() -> list[Callable[[], Any]]:
        kept: list[bytes] = []
        return [*(lambda c=c: kept.append(c) for c in chunks), lambda: b"".join(kept)]

    def extend_each() -> list[Callable[[], Any]]:
        out = bytearray()
        return [lambda c=c: out.extend(c) for c in chunks]

    gathering = (
        "gather the body (event loop: longest call)",
        "chunks kept, b''.join at the end",
        longest_call(join_at_end),
        "one buffer extended per chunk",
        longest_call(extend_each),
    )
    steps = [
        (
            "count JSON values (reader thread: longest stall)",
            "bytes.count over the whole body",
            lambda: sum(body.count(c) for c in (b",", b"[", b"{")),
            "in SCAN_STEP steps (json_values)",
            lambda: parse.json_values(body),
        ),
        (
            "read the items (reader thread: longest stall)",
            "json.loads + encode_json",
            lambda: parse.encode_json(json.loads(body), IMAGES),
            "encode_json_bytes (item by item)",
            lambda: parse.encode_json_bytes(body, IMAGES),
        ),
    ]
    assert parse.encode_json_bytes(body, IMAGES) == parse.encode_json(
        parse.json_body(body, allowed), IMAGES
    )
    lines = [
        "# Reading a large body: the longest the ingress's other work waits "
        "(`loadtest/bench_body_reading.py`)",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} vCPUs. Body: a {len(body) / 2**20:.1f} MiB "
        f"`/v1/encode` JSON document of {IMAGES} images (1 MiB of base64 each), in "
        f"{len(chunks)} chunks of 64 KiB. Gathering runs on the event loop: its longest single "
        "call is what the loop waited. The other steps run in a reader thread while the main "
        "thread wakes every 1 ms: *longest stall* is the longest gap between its wake-ups "
        f"(what the event loop, `/healthz` included, waited). Medians of {args.repeat} runs.",
        "",
        "| step | before (issue 25) | took ms | longest call / stall ms | now | took ms | "
        "longest call / stall ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, old_name, old, new_name, new in [gathering, *steps]:
        measure = (lambda f: f()) if name.startswith("gather") else longest_stall
        before = [measure(old) for _ in range(args.repeat)]
        after = [measure(new) for _ in range(args.repeat)]

        def ms(samples: list[tuple[float, float]], k: int) -> str:
            return f"{statistics.median(s[k] for s in samples) * 1000:.0f}"

        lines.append(
            f"| {name} | {old_name} | {ms(before, 0)} | {ms(before, 1)} | {new_name} | "
            f"{ms(after, 0)} | {ms(after, 1)} |"
        )
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
