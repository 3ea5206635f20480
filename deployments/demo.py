"""``vitserve demo``: the encoder end to end on a random-weight model, offline.

Builds (once, into the cache folder) a small random-weight model unless one is given, encodes a
set of generated images of mixed resolution twice, and prints each image's key and token count,
the batches the planner formed, and timings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from vitserve.encoder.testimages import make_image

# (width, height, mode, format): a mixed-resolution request, with one image sent twice.
DEMO_IMAGES = [
    (448, 448, "RGB", "JPEG"),
    (448, 448, "RGB", "PNG"),
    (448, 448, "L", "PNG"),
    (333, 517, "RGBA", "PNG"),
    (640, 480, "RGB", "WEBP"),
    (1280, 720, "RGB", "JPEG"),
]


def demo_images() -> list[bytes]:
    images = [
        make_image(w, h, mode=mode, fmt=fmt, seed=i)
        for i, (w, h, mode, fmt) in enumerate(DEMO_IMAGES)
    ]
    return [*images, images[0]]  # the first image again: same key, encoded once


def run_demo(
    model: str | None,
    *,
    family: str = "qwen2_vl",
    preset: str = "small",
    device: str | None = None,
    dtype: str | None = None,
    echo: Callable[[str], None] = print,
) -> None:
    from vitserve.encoder.device import dtype_name
    from vitserve.encoder.engine import EncoderEngine
    from vitserve.encoder.testmodels import cached_model

    if model is None:
        started = time.perf_counter()
        model = str(cached_model(family, preset))
        echo(f"model: random-weight {family} ({preset}) at {model} "
             f"[{time.perf_counter() - started:.1f} s]")  # fmt: skip
    started = time.perf_counter()
    engine = EncoderEngine.from_pretrained(model, device=device, dtype=dtype)
    report = engine.load_report
    echo(
        f"loaded the vision side of {Path(model).name} on {engine.device} in "
        f"{dtype_name(engine.dtype)} in {time.perf_counter() - started:.2f} s: "
        f"{report.tensors_read} tensors, {report.bytes_read / 2**20:.1f} MiB read of a "
        f"{report.checkpoint_bytes / 2**20:.1f} MiB checkpoint "
        f"({len(report.shards_read)}/{report.shards_total} shards)"
    )
    cap = engine.max_batch_patches
    echo(f"activation budget: {engine.budget_bytes / 2**20:.0f} MiB"
         + (f"; at most {cap} patches per forward (CPU cache cap)" if cap else ""))  # fmt: skip

    images = demo_images()
    names = [f"{w}x{h} {mode} {fmt}" for w, h, mode, fmt in [*DEMO_IMAGES, DEMO_IMAGES[0]]]
    started = time.perf_counter()
    prepared = engine.prepare(images)
    prep_s = time.perf_counter() - started
    first: dict[str, int] = {}
    for i, p in enumerate(prepared):
        first.setdefault(p.key, i)
    unique = [prepared[i] for i in first.values()]
    echo(f"\n{len(images)} images ({len(unique)} distinct), preprocessed in {prep_s:.2f} s")
    echo(f"{'#':>2}  {'input':<17} {'key':<18} {'grid':<9} {'patches':>7} {'tokens':>6}")
    for i, (name, p) in enumerate(zip(names, prepared, strict=True)):
        grid = "x".join(map(str, p.grid)) if p.grid else "-"
        same = f"  (same bytes as #{first[p.key]})" if first[p.key] != i else ""
        echo(f"{i:>2}  {name:<17} {p.key[:16]}.. {grid:<9} {p.patches:>7} {p.num_tokens:>6}{same}")

    plan = engine.plan(unique)
    echo(f"\nbatches: {plan.forward_calls} tower forwards for {len(unique)} distinct images")
    for n, batch in enumerate(plan.batches):
        members = [first[unique[j].key] for j in batch.indices]
        note = " (over budget alone)" if batch.oversize else ""
        echo(f"  forward {n}: bucket {batch.bucket}, images {members}, {batch.patches} patches, "
             f"~{batch.act_bytes / 2**20:.0f} MiB activations{note}")  # fmt: skip

    started = time.perf_counter()
    results = engine.encode(images)
    elapsed = time.perf_counter() - started
    c = engine.counters
    echo(f"\nencoded in {elapsed:.2f} s: {c.forward_calls} tower forwards, {c.images} images "
         f"through the tower, {c.patches} patches, {len(unique) / elapsed:.2f} images/s; "
         f"embeddings {[tuple(r.tensor.shape) for r in results]}")  # fmt: skip
