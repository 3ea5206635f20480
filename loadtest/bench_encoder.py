"""Encoder batching benchmark: per-image loop vs naive padding vs vitserve's bucketed batching.

One run, one machine, one model; the three strategies run interleaved round by round, in an
order rotated each round, so that drift (another process on the cores, thermal state) and
order effects hit them alike; medians and per-round paired ratios are reported.

Workload: ``--requests`` requests, each of six 480x480 images plus one 1280x720 or 1920x1080
image (alternating), all distinct. Each request is one encode call:

* ``loop``: every image through the tower alone (one forward per image).
* ``padded``: every image of a request resized as the processor would, then padded (black,
  bottom/right) to the request's largest resized width and height, so that all share one shape:
  the static-shape batching of a naive server. Its extra tokens are ``padded-token waste``; its
  embeddings are not the unpadded ones.
* ``bucketed``: ``EncoderEngine.run``: the planner's buckets under the activation budget.

``padded`` and ``bucketed`` go through the same planner, with the engine's budget and (on a
CPU) its cache-sized cap on patches per forward.

Prints images/s, tower forward calls, padded-token waste and achieved GFLOP/s (matmul FLOPs the
tower executed per second, padding included; "useful" counts only the unpadded images' FLOPs)
against this machine's matmul peak for the dtype, measured in the same run.

    python loadtest/bench_encoder.py --family qwen2_vl --preset small --dtype fp32 bf16
    python loadtest/bench_encoder.py --family qwen2_5_vl --preset large --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from PIL import Image

STRATEGIES = ("loop", "padded", "bucketed")


@dataclass
class Result:
    strategy: str
    seconds: list[float]
    images: int
    forward_calls: int
    tokens_real: int  # tower sequence rows of the unpadded images
    tokens_run: int  # tower sequence rows actually run (padding included)
    flops_run: float
    flops_useful: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def images_per_s(self) -> float:
        return self.images / self.median_s

    @property
    def waste(self) -> float:
        return 1 - self.tokens_real / self.tokens_run


def workload(requests: int) -> list[list[bytes]]:
    from vitserve.testing.images import make_image

    out = []
    for r in range(requests):
        big = (1280, 720) if r % 2 == 0 else (1920, 1080)
        sizes = [(480, 480)] * 6 + [big]
        out.append(
            [make_image(w, h, fmt="JPEG", seed=1000 * r + i) for i, (w, h) in enumerate(sizes)]
        )
    return out


def padded_engine(engine: Any) -> Any:
    """An engine sharing ``engine``'s modules whose processor does not resize (inputs are
    already at a size it accepts)."""
    import copy

    from vitserve.encoder.engine import EncoderEngine

    a = engine.adapter
    processor = copy.deepcopy(a.processor)
    processor.do_resize = False
    adapter = type(a)(a.config, processor, a.modules, device=a.device, dtype=a.dtype)
    return EncoderEngine(adapter, fingerprint=engine.fingerprint, budget_bytes=engine.budget_bytes)


def pad_request(engine: Any, images: list[bytes]) -> list[Any]:
    """Naive static-shape batching: each image resized as the model's processor would, then
    pasted top-left on a black canvas of the request's largest resized width x height (so every
    image of the request has the largest grid), then preprocessed without another resize."""
    from vitserve.encoder.images import decode_image

    prepared = [engine.prepare_one(b) for b in images]
    if prepared[0].grid is None:  # fixed-size towers: every image already has one shape
        return prepared
    patch = engine.adapter.config.vision_config.patch_size
    sizes = [(p.grid[2] * patch, p.grid[1] * patch) for p in prepared]
    width, height = max(w for w, _ in sizes), max(h for _, h in sizes)
    no_resize = padded_engine(engine)
    out = []
    for data, (w, h) in zip(images, sizes, strict=True):
        canvas = Image.new("RGB", (width, height))
        canvas.paste(decode_image(data).resize((w, h), Image.Resampling.BICUBIC), (0, 0))
        buf = io.BytesIO()
        canvas.save(buf, "PNG")
        out.append(no_resize.prepare_one(buf.getvalue()))
    return out


def matmul_peak_gflops(device: Any, dtype: Any, seconds: float = 1.0) -> float:
    """Best GFLOP/s of square ``matmul`` or ``linear`` of ``dtype`` on ``device`` (size 2048 on
    CPU, 8192 on GPU; 1024 on a CPU without native support for the dtype, where 2048 takes
    minutes). Both kernels are tried: on CPUs without native bf16, oneDNN's bf16 ``linear``
    (what the tower's dense layers use) is ~15x faster than bf16 ``matmul``."""
    import torch

    from vitserve.encoder.device import cpu_has_native_bf16

    if device.type == "cuda":
        n = 8192
    elif dtype == torch.float32 or cpu_has_native_bf16():
        n = 2048
    else:
        n = 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = 0.0
    deadline = time.perf_counter() + seconds
    first = True
    while first or time.perf_counter() < deadline:
        first = False
        for op in (torch.matmul, torch.nn.functional.linear):
            _sync(device)
            t = time.perf_counter()
            op(a, b)
            _sync(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_strategy(engine: Any, strategy: str, prepared: list[list[Any]]) -> tuple[float, int]:
    """Seconds and forward calls to run every request once with ``strategy``."""
    before = engine.counters.forward_calls
    _sync(engine.device)
    started = time.perf_counter()
    for request in prepared:
        if strategy == "loop":
            for p in request:
                engine.run([p])
        else:  # padded images share one shape: the planner puts them in one bucket
            engine.run(request)
    _sync(engine.device)
    return time.perf_counter() - started, engine.counters.forward_calls - before


def bench_dtype(args: argparse.Namespace, dtype_name: str) -> dict[str, Any]:
    from vitserve.encoder.engine import EncoderEngine
    from vitserve.testing.models import cached_model

    model = args.model or str(cached_model(args.family, args.preset))
    engine = EncoderEngine.from_pretrained(
        model, device=args.device, dtype=dtype_name, budget_bytes=args.budget_bytes
    )
    requests = workload(args.requests)
    prepared = {
        "loop": [[engine.prepare_one(b) for b in r] for r in requests],
        "padded": [pad_request(engine, r) for r in requests],
    }
    prepared["bucketed"] = prepared["loop"]
    adapter = engine.adapter
    real = [p for r in prepared["loop"] for p in r]
    results = {
        s: Result(
            strategy=s,
            seconds=[],
            images=len(real),
            forward_calls=0,
            tokens_real=sum(p.seq_len for p in real),
            tokens_run=sum(p.seq_len for r in prepared[s] for p in r),
            flops_run=sum(adapter.flops(p) for r in prepared[s] for p in r),
            flops_useful=sum(adapter.flops(p) for p in real),
        )
        for s in STRATEGIES
    }
    peak = matmul_peak_gflops(engine.device, engine.dtype)
    engine.run([real[0]])  # warm-up: allocator, kernels, thread pools
    for r in range(args.rounds):
        # Rotate the order each round: whichever runs right after another pays for its
        # leftovers (caches, allocator state, the host's other load) in turn.
        for s in STRATEGIES[r % 3 :] + STRATEGIES[: r % 3]:
            seconds, calls = run_strategy(engine, s, prepared[s])
            results[s].seconds.append(seconds)
            results[s].forward_calls = calls
            print(f"  [{dtype_name}] {s:<9} {seconds:8.2f} s  {calls} forwards", flush=True)
    # The peak is measured before and after the strategies; the higher counts (less noise).
    peak = max(peak, matmul_peak_gflops(engine.device, engine.dtype))
    return {
        "dtype": dtype_name,
        "device": str(engine.device),
        "model": model,
        "peak_gflops": peak,
        "results": results,
        "prepare_patches": [p.patches for p in prepared["loop"][0]],
    }


def report(run: dict[str, Any]) -> None:
    peak = run["peak_gflops"]
    res: dict[str, Result] = run["results"]
    print(
        f"\n== {run['dtype']} on {run['device']}: matmul peak {peak:.1f} GFLOP/s; "
        f"patches per request {run['prepare_patches']}"
    )
    print(
        f"{'strategy':<9} {'median s':>9} {'images/s':>9} {'forwards':>9} {'waste':>7} "
        f"{'GFLOP/s':>9} {'useful':>9} {'% peak':>7}"
    )
    for s in STRATEGIES:
        r = res[s]
        achieved = r.flops_run / r.median_s / 1e9
        useful = r.flops_useful / r.median_s / 1e9
        print(
            f"{s:<9} {r.median_s:9.2f} {r.images_per_s:9.3f} {r.forward_calls:9d} "
            f"{r.waste:7.1%} {achieved:9.1f} {useful:9.1f} {achieved / peak:7.1%}"
        )
    b = res["bucketed"].images_per_s
    print(
        f"bucketed / loop throughput: {b / res['loop'].images_per_s:.2f}x; "
        f"bucketed / padded: {b / res['padded'].images_per_s:.2f}x"
    )
    for other in ("loop", "padded"):
        paired = [o / t for o, t in zip(res[other].seconds, res["bucketed"].seconds, strict=True)]
        rounds = ", ".join(f"{r:.2f}" for r in paired)
        median = statistics.median(paired)
        print(f"  per round, {other} time / bucketed time: {rounds} (median {median:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="qwen2_vl")
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "large"))
    parser.add_argument("--model", help="a model folder or HF id instead of a test model")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", nargs="+", default=["fp32"])
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-bytes", type=int, default=None)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    runs = [bench_dtype(args, d) for d in args.dtype]
    for run in runs:
        report(run)
    if len(runs) > 1:
        base = runs[0]["results"]["bucketed"].images_per_s
        for run in runs[1:]:
            ratio = run["results"]["bucketed"].images_per_s / base
            print(f"bucketed {run['dtype']} / {runs[0]['dtype']} throughput: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{**r, "results": {k: asdict(v) for k, v in r["results"].items()}} for r in runs],
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
