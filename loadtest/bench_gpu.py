"""GPU benchmark: vitserve's bucketed batching vs one image at a time, on a real-size tower.

One model: a vision tower of its family's published size with random weights (the ``large``
preset of ``vitserve.testing.models``: for the default family, Qwen2-VL's tower from
transformers' own ``Qwen2VLConfig``, 1280 wide and 32 layers deep), saved and loaded back
through the vision-only path a published checkpoint takes, in the device's default dtype (bf16
on a GPU). One workload: a mixed set of resolutions, from 224x224 thumbnails to 1080p, prepared
once on the CPU (not timed). Two strategies of vitserve's own engine (``EncoderEngine.run``):

* ``per-image``: every image through the tower alone, one forward each;
* ``bucketed``: the whole set in one call: the planner's buckets under the activation budget
  (half the device's free memory at start), one forward per batch.

Prints images/s and patches/s (median over rounds), forwards, peak device memory and how far
the bucketed embeddings lie from the per-image ones (ulps of their scale), and writes a results
page, ``loadtest/results/gpu-<card>.md`` (``gpu-<card>-<family>.md`` for another family than
the default), that names the card.

Invariants:

* Both strategies encode the same prepared images with the same engine; every round runs both,
  in an order that alternates, after one untimed warm-up pass of each.
* A time spans the device's work: the device is synchronized before the clock starts and
  before it stops.
* It refuses (exit 2, saying why) on a machine without a working CUDA device, unless asked for
  a smoke run (``--device cpu --tiny``: the tiny test tower, a few small images, one round),
  which writes a page only where ``--out`` says, so it never overwrites a GPU's figures.

    .venv/bin/python loadtest/bench_gpu.py                       # make bench-gpu
    .venv/bin/python loadtest/bench_gpu.py --family qwen2_5_vl --rounds 9
    .venv/bin/python loadtest/bench_gpu.py --device cpu --tiny   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitserve.encoder.device import cpu_model, dtype_name, probe_cuda

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "loadtest" / "results"
STRATEGIES = ("per-image", "bucketed")
# (count, width, height) of the image set: many thumbnails, fewer large images, as a chat load.
GPU_SET = ((16, 224, 224), (8, 448, 448), (4, 640, 480), (2, 1280, 720), (2, 1920, 1080))
TINY_SET = ((3, 64, 64), (2, 200, 120), (1, 333, 517))
DEFAULT_FAMILY = "qwen2_vl"


@dataclass
class Measured:
    """One strategy's rounds."""

    name: str
    seconds: list[float] = field(default_factory=list)
    forwards: int = 0
    peak_bytes: int | None = None  # device memory at its peak (CUDA only)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def page_name(card: str, family: str = DEFAULT_FAMILY) -> str:
    """The results page of a card and family: ``NVIDIA H100 80GB HBM3`` ->
    ``gpu-nvidia-h100-80gb-hbm3.md`` for the default family, ``...-<family>.md`` for another."""
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-") or "unknown"
    return f"gpu-{slug}.md" if family == DEFAULT_FAMILY else f"gpu-{slug}-{family}.md"


def image_set(sizes: tuple[tuple[int, int, int], ...]) -> list[tuple[str, bytes]]:
    """Named JPEGs of the given sizes, each with its own content."""
    from vitserve.testing.images import make_image  # heavy: PIL, numpy

    images = []
    for count, width, height in sizes:
        for i in range(count):
            seed = 29_000 + 1000 * width + 10 * height + i
            images.append((f"{width}x{height}", make_image(width, height, fmt="JPEG", seed=seed)))
    return images


def _sync(device: Any) -> None:
    import torch  # heavy: the refusals and --help answer without torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(engine: Any, strategy: str, prepared: list[Any]) -> tuple[float, int, list[Any]]:
    """Seconds, forwards and embeddings of one pass of ``strategy`` over ``prepared``."""
    before = engine.counters.forward_calls
    _sync(engine.device)
    started = time.perf_counter()
    if strategy == "per-image":
        out = [engine.run([p])[0] for p in prepared]
    else:
        out = engine.run(prepared)
    _sync(engine.device)
    return time.perf_counter() - started, engine.counters.forward_calls - before, out


def measure(engine: Any, prepared: list[Any], rounds: int) -> tuple[dict[str, Measured], float]:
    """Every strategy's rounds, and the largest distance of a bucketed embedding (or extra)
    from the same image's per-image one, in ulps of its scale."""
    import torch  # heavy: the refusals and --help answer without torch

    from vitserve.encoder.engine import ulps_apart

    cuda = engine.device.type == "cuda"
    results = {s: Measured(s) for s in STRATEGIES}
    last: dict[str, list[Any]] = {}
    for s in STRATEGIES:  # warm-up: kernels chosen, allocator grown
        run_once(engine, s, prepared)
    for r in range(rounds):
        for s in STRATEGIES if r % 2 == 0 else STRATEGIES[::-1]:
            last.pop(s, None)  # its previous outputs do not count in its peak
            if cuda:
                torch.cuda.reset_peak_memory_stats(engine.device)
            seconds, forwards, last[s] = run_once(engine, s, prepared)
            m = results[s]
            m.seconds.append(seconds)
            m.forwards = forwards
            if cuda:
                peak = torch.cuda.max_memory_allocated(engine.device)
                m.peak_bytes = max(m.peak_bytes or 0, peak)
            print(f"  round {r + 1}: {s:<9} {seconds:8.3f} s  {forwards} forwards", flush=True)
    ulps = max(
        ulps_apart(x, y)
        for a, b in zip(last["bucketed"], last["per-image"], strict=True)
        for x, y in [(a.tensor, b.tensor), *((a.extras[k], b.extras[k]) for k in a.extras)]
    )
    return results, ulps


def describe_device(device: Any) -> dict[str, str]:
    import torch  # heavy: the refusals and --help answer without torch
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "host": f"{cpu_model()}, {os.cpu_count()} vCPUs",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["card"] = torch.cuda.get_device_name(device)
        info["memory"] = f"{props.total_memory / 2**30:.1f} GiB"
        info["cuda"] = str(torch.version.cuda)
    else:
        info["card"] = "cpu (smoke run)"
    return info


def render(run: dict[str, Any]) -> str:
    """The results page (Markdown)."""
    info, res = run["info"], run["results"]
    per, bucketed = res["per-image"], res["bucketed"]
    n, patches = run["images"], run["patches"]
    lines = [
        f"# Bucketed vs per-image encoding, {run['family']} tower, on {info['card']} "
        f"({run['date']})",
        "",
        f"Card: {info['card']}"
        + (f" ({info['memory']}, CUDA {info['cuda']})" if "cuda" in info else "")
        + f"; torch {info['torch']}, transformers {info['transformers']}; host {info['host']}.",
        f"Model: {run['family']} vision tower and merger ({run['shape']}; "
        f"{run['params'] / 1e6:.3g}M parameters), {run['source']}, loaded through the "
        f"vision-only loader; {run['dtype']}, activation budget {run['budget'] / 2**30:.2f} GiB.",
        f"Workload: {n} images ({run['set']}; {patches} patches), prepared once on the CPU (not "
        f"timed); per round each strategy encodes all of them, in alternating order, after one "
        f"untimed warm-up pass of each; {run['rounds']} round{'s' * (run['rounds'] != 1)}.",
        "",
        "| strategy | median s | images/s | patches/s | forwards | peak allocated |",
        "|---|---|---|---|---|---|",
    ]
    for m in (per, bucketed):
        peak = f"{m.peak_bytes / 2**30:.2f} GiB" if m.peak_bytes is not None else "n/a"
        lines.append(
            f"| {m.name} | {m.median_s:.3f} | {n / m.median_s:.1f} | {patches / m.median_s:.0f} "
            f"| {m.forwards} | {peak} |"
        )
    paired = [p / b for p, b in zip(per.seconds, bucketed.seconds, strict=True)]
    lines += [
        "",
        f"bucketed / per-image throughput: {per.median_s / bucketed.median_s:.2f}x (per round: "
        + ", ".join(f"{x:.2f}" for x in paired)
        + f"; median {statistics.median(paired):.2f}).",
        f"Bucketed vs per-image embeddings: at most {run['ulps']:.3g} ulps of their scale (the "
        f"engine's promise in {run['dtype']}: {run['promise']}, tested on depth-2 test towers; "
        "a deeper tower compounds rounding over its layers).",
        "",
        "Peak allocated: torch's device memory at its peak in a strategy's pass, weights "
        "included (CUDA only).",
        f"Rerun: `{run['command']}` (`make bench-gpu BENCH_GPU_ARGS=...` runs the same).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default=DEFAULT_FAMILY, help="test-model family (%(default)s)")
    parser.add_argument("--model", help="a model folder instead of the family's test model")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--tiny", action="store_true", help="smoke run: tiny tower, a few small images, one round"
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), help="default: the device's (bf16 on a GPU)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default: 5 (--tiny: 1)")
    parser.add_argument("--budget-bytes", type=int, default=None)
    parser.add_argument(
        "--out",
        type=Path,
        help="the page (default on CUDA: loadtest/results/gpu-<card>[-<family>].md)",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.tiny:
        parser.error(
            "--device cpu runs only with --tiny (a smoke run of this script): the real-size "
            "tower takes minutes per pass on a CPU"
        )
    if args.device == "cuda":
        probe = probe_cuda()
        if probe.state != "ok":
            parser.error(
                f"this benchmark needs a working CUDA device, and here {probe.detail}. "
                "For a smoke run without one: --device cpu --tiny"
            )
    rounds = args.rounds or (1 if args.tiny else 5)
    if rounds < 1:
        parser.error("--rounds must be at least 1")

    # heavy, after the refusals: torch, transformers and the model
    from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, EncoderEngine
    from vitserve.testing.models import cached_model

    preset = "tiny" if args.tiny else "large"
    if args.model:
        model = args.model
    else:
        print(f"building (once, then cached) the {args.family} `{preset}` test model ...")
        model = str(cached_model(args.family, preset))
    engine = EncoderEngine.from_pretrained(
        model, device=args.device, dtype=args.dtype, budget_bytes=args.budget_bytes
    )
    sizes = TINY_SET if args.tiny else GPU_SET
    prepared = [engine.prepare_one(data, i) for i, (_, data) in enumerate(image_set(sizes))]
    info = describe_device(engine.device)
    shape = engine.adapter.tower_shape
    print(
        f"{info['card']}: {engine.family} tower {shape.width} wide x {shape.depth} layers, "
        f"{engine.dtype}, budget {engine.budget_bytes / 2**30:.2f} GiB; {len(prepared)} images"
    )
    results, ulps = measure(engine, prepared, rounds)
    run = {
        "info": info,
        "results": results,
        "ulps": ulps,
        "images": len(prepared),
        "patches": sum(p.patches for p in prepared),
        "set": ", ".join(f"{c} x {w}x{h}" for c, w, h in sizes),
        "family": engine.family,
        "source": f"from `{args.model}`"
        if args.model
        else f"random weights from the `{preset}` preset of `vitserve.testing.models`",
        "shape": f"{shape.width} wide, {shape.depth} layers, {shape.heads} heads, MLP {shape.mlp}",
        "params": sum(p.numel() for m in engine.adapter.modules.values() for p in m.parameters()),
        "dtype": dtype_name(engine.dtype),
        "promise": f"{BATCH_TOLERANCE_ULPS[dtype_name(engine.dtype)]:g} ulps"
        if dtype_name(engine.dtype) in BATCH_TOLERANCE_ULPS
        else "none stated",
        "budget": engine.budget_bytes,
        "rounds": rounds,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": " ".join(
            [".venv/bin/python loadtest/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    text = render(run)
    print("\n" + text)
    out = args.out
    if out is None and engine.device.type == "cuda":
        out = RESULTS / page_name(info["card"], engine.family)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
        if out.resolve().parent == RESULTS:
            print("a new page under loadtest/results: `make readme` lists it in the README")


if __name__ == "__main__":
    main()
