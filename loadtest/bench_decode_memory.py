"""What decoding and preprocessing one image takes in memory, against what admission counts.

For each family's tiny test model (its image processor; no weights are used) and each image
kind (PNG in RGB, RGBA, grayscale, palette and 16-bit grayscale; JPEG in RGB and CMYK), one
flat ``side`` x ``side`` image is prepared (``Preprocessor.prepare``: decode, RGB conversion,
the family's image processor) in a fresh process, and the peak of its resident set over what
it held before (glibc trimmed, Linux's VmHWM reset) is reported in bytes per pixel, beside the
estimate ``vitserve.encoder.work`` counts for it (decoding plus prepared arrays). The upload's
size is reported too: what a client sends for that work.

    .venv/bin/python loadtest/bench_decode_memory.py --out loadtest/results/decode-memory-cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KINDS = ("png-rgb", "png-rgba", "png-l", "png-p", "png-i16", "jpeg-rgb", "jpeg-cmyk")

# One measurement, in a process of its own (argv: model folder, kind, side).
_ONE = """
import ctypes, io, json, sys
import numpy as np
from PIL import Image
from vitserve.encoder.images import ImageLimits, image_header
from vitserve.encoder.loading import load_preprocessor
from vitserve.encoder.preprocess import Preprocessor
model, kind, side = sys.argv[1], sys.argv[2], int(sys.argv[3])
adapter = load_preprocessor(model)
pre = Preprocessor(adapter, ImageLimits(max_image_bytes=2**31, max_image_pixels=10**9))
fmt, mode = kind.split("-")
if mode == "i16":
    im = Image.fromarray(np.full((side, side), 40000, np.uint16))
else:
    mode = {"rgb": "RGB", "rgba": "RGBA", "l": "L", "p": "P", "cmyk": "CMYK"}[mode]
    im = Image.new(mode, (side, side), 90 if mode in ("L", "P") else (90, 20, 200, 255)[:len(mode)])
buf = io.BytesIO()
im.save(buf, fmt.upper())
data = buf.getvalue()
del im, buf
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")
prepared = pre.prepare(data, "k")
peak = status("VmHWM:") - before
width, height, pil_mode = image_header(data, limits=pre.limits)
work = adapter.resize_rule().work(width, height, pil_mode)
print(json.dumps({"upload": len(data), "peak": peak, "estimate": work.decode_bytes +
                  work.prepared_bytes, "pixels": width * height}))
"""


def measure(model: Path, kind: str, side: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _ONE, str(model), kind, str(side)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen2_vl", "llava", "gemma3"])
    parser.add_argument("--sides", nargs="+", type=int, default=[3000, 6000])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from vitserve.encoder.device import cpu_model, describe_cpu
    from vitserve.testing.models import make_model

    root = Path(tempfile.mkdtemp(prefix="vitserve-decode-"))
    lines = [
        "# Decoding memory per image (`loadtest/bench_decode_memory.py`)",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} vCPUs, {describe_cpu()}. Each row: "
        "one flat image prepared in a fresh process; peak resident-set growth over the "
        "process before it, and the bytes `vitserve.encoder.work` counts for it (decoding + "
        "prepared arrays), both per pixel.",
        "",
        "| family | image | side | upload KB | peak MiB | peak B/px | counted B/px "
        "| counted / peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in args.families:
        model = make_model(family, "tiny", root / family)
        for kind in KINDS:
            for side in args.sides:
                got = measure(model, kind, side)
                px = got["pixels"]
                row = (
                    f"| {family} | {kind} | {side} | {got['upload'] / 1e3:.0f} | "
                    f"{got['peak'] / 2**20:.0f} | {got['peak'] / px:.1f} | "
                    f"{got['estimate'] / px:.1f} | {got['estimate'] / got['peak']:.2f} |"
                )
                print(row, flush=True)
                lines.append(row)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
