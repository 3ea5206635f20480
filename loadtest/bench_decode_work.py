"""What decoding a work bomb would cost, against what refusing it costs.

For each kind of file whose structure, not its pixels, makes decoding costly (a progressive JPEG
whose last scan repeats, stray bytes before a JPEG's first scan, a PNG in 1-byte chunks, a GIF
comment of one-byte sub-blocks) and its harmless twin (the same pixels, an ordinary structure),
the CPU seconds of ``decode_image`` with the structure limits lifted (what every image cost
before ``vitserve.encoder.decode_work``), and of ``image_header`` under the default limits
(what admission now spends to refuse it), each the median of ``--repeats`` runs in this process.

    .venv/bin/python loadtest/bench_decode_work.py --out loadtest/results/decode-work-cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times)


def header(data: bytes, limits: object) -> None:
    """``image_header`` of ``data``, its refusal included (what admission spends)."""
    from vitserve.encoder.images import image_header
    from vitserve.errors import ImageTooLargeError

    with contextlib.suppress(ImageTooLargeError):
        image_header(data, limits=limits)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from vitserve.encoder.device import cpu_model, describe_cpu
    from vitserve.encoder.images import DEFAULT_LIMITS, ImageLimits, decode_image, image_header
    from vitserve.errors import ImageTooLargeError
    from vitserve.testing import images as t

    lifted = ImageLimits(max_jpeg_scans=10**9, max_structure_steps=10**9)
    cases: list[tuple[str, Callable[[], bytes]]] = [
        ("JPEG 2048x2048 grey, progressive (twin)", lambda: t.jpeg_scan_bomb(2048, 0)),
        ("JPEG 2048x2048 grey, +58 scans (64: at the limit)", lambda: t.jpeg_scan_bomb(2048, 58)),
        ("JPEG 2048x2048 grey, +500 scans", lambda: t.jpeg_scan_bomb(2048, 500)),
        ("JPEG 2048x2048 grey, +2000 scans", lambda: t.jpeg_scan_bomb(2048, 2000)),
        ("JPEG 64x48 (twin)", lambda: t.jpeg_with_stray_bytes(0)),
        ("JPEG 64x48, 1 M stray bytes", lambda: t.jpeg_with_stray_bytes(1_000_000)),
        ("JPEG 64x48, 16 M stray bytes", lambda: t.jpeg_with_stray_bytes(16_000_000)),
        ("PNG 96x64 in one chunk (twin)", lambda: t.png_in_tiny_chunks(2**20)),
        ("PNG 96x64 in 1-byte chunks", lambda: t.png_in_tiny_chunks(1)),
        ("GIF 64x48 (twin)", lambda: t.gif_with_sub_blocks(0)),
        ("GIF 64x48, 1 M one-byte sub-blocks", lambda: t.gif_with_sub_blocks(1_000_000)),
        ("GIF 64x48, 8 M one-byte sub-blocks", lambda: t.gif_with_sub_blocks(8_000_000)),
    ]
    lines = [
        "# Decode work bombs: their decode against their refusal (`loadtest/bench_decode_work.py`)",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} vCPUs, {describe_cpu()}. CPU seconds, the "
        f"median of {args.repeats} runs: `decode_image` with the structure limits lifted (what "
        "the file cost an encoder replica before they existed), and `image_header` under the "
        "default limits (what admission spends on it now; a refusal names the limit).",
        "",
        "| file | KB | decode, limits lifted (s) | header read (ms) | answer |",
        "|---|---|---|---|---|",
    ]
    for name, make in cases:
        data = make()
        decode = cpu_seconds(functools.partial(decode_image, data, limits=lifted), args.repeats)
        answer = "accepted"
        try:
            image_header(data, limits=DEFAULT_LIMITS)
        except ImageTooLargeError as exc:
            answer = f"413 `{exc.limit}` ({exc.value} > {exc.allowed})"
        read = cpu_seconds(functools.partial(header, data, DEFAULT_LIMITS), args.repeats)
        row = f"| {name} | {len(data) / 1e3:.0f} | {decode:.3f} | {read * 1e3:.2f} | {answer} |"
        print(row, flush=True)
        lines.append(row)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
