"""GPU profile of a published-size tower: where one bucketed pass spends the chip's time.

Scouting for issue 44 (one attention call per layer): prints the card's bf16 matrix-product
peak, whether this torch has variable-length and block-masked attention, a torch.profiler
table of one warm bucketed pass of the 32-image mixed set of ``bench_gpu.py`` for Qwen2.5-VL and
Qwen2-VL (with the count of attention calls), and one Qwen2.5-VL window layer for a 1080p image
(16 heads of 80, 180 windows) through per-window SDPA and through ``varlen_attn``.

Invariants:

* Every time spans the device's work (synchronized before the clock starts and stops), after
  warm-up calls; the profiled pass follows two untimed passes.
* It prints and writes nothing else: its figures go to a page under loadtest/results by hand
  (tower-profile-<card>.md), with the card named.

    python3 loadtest/profile_gpu_tower.py     # on a CUDA machine, vitserve installed
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

FAMILIES = ("qwen2_5_vl", "qwen2_vl")
# One Qwen2.5-VL window layer for a 1080p image: 16 heads of 80; 160 windows of 64, 20 of 32.
HEADS, HEAD_DIM, WINDOWS = 16, 80, [64] * 160 + [32] * 20


def timed(fn, calls: int, warm: int = 3) -> float:
    """Seconds per call of ``fn`` on the device, after ``warm`` calls."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls


def matmul_peak() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * 8192**3 / timed(lambda: a @ b, 10) / 1e12


def profile_family(family: str) -> None:
    import torch
    from bench_gpu import GPU_SET, image_set
    from torch.profiler import ProfilerActivity, profile

    from vitserve.encoder.engine import EncoderEngine
    from vitserve.testing.models import cached_model

    engine = EncoderEngine.from_pretrained(str(cached_model(family, "large")), device="cuda")
    prepared = [engine.prepare_one(d, i) for i, (_, d) in enumerate(image_set(GPU_SET))]
    for _ in range(2):
        engine.run(prepared)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.run(prepared)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(f"== {family}: bucketed pass profile")
    print(averages.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    sdpa = [e.count for e in averages if e.key == "aten::scaled_dot_product_attention"]
    print("sdpa calls:", sdpa[0] if sdpa else 0, flush=True)


def window_layer() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.varlen import varlen_attn

    total = sum(WINDOWS)
    q, k, v = (
        torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    cu = torch.tensor([0, *torch.tensor(WINDOWS).cumsum(0).tolist()], device="cuda")
    cu = cu.to(torch.int32)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))

    def per_window() -> torch.Tensor:
        def one(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return x[a:b].transpose(0, 1)[None]

        return torch.cat(
            [
                F.scaled_dot_product_attention(one(q, a, b), one(k, a, b), one(v, a, b))[
                    0
                ].transpose(0, 1)
                for a, b in bounds
            ]
        )

    def one_call() -> torch.Tensor:
        return varlen_attn(q, k, v, cu, cu, max(WINDOWS), max(WINDOWS))

    for fn in (per_window, one_call):
        print(f"{fn.__name__}: {timed(fn, 20) * 1e3:.3f} ms per layer", flush=True)
    gap = (per_window().float() - one_call().float()).abs().max().item()
    print(f"max |per_window - one_call|: {gap}")


def main() -> None:
    import torch

    print(f"bf16 matmul peak: {matmul_peak():.0f} TFLOP/s; torch {torch.__version__}", flush=True)
    for name in ("torch.nn.attention.varlen", "torch.nn.attention.flex_attention"):
        try:
            importlib.import_module(name)
            print(name, "imports")
        except ImportError as e:
            print(name, "missing:", e)
    for family in FAMILIES:
        profile_family(family)
        torch.cuda.empty_cache()
    window_layer()


if __name__ == "__main__":
    main()
