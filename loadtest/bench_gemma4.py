"""Gemma 4's tower on a mixed set of images and video frames: one item at a time vs vitserve's
batching.

One run, one machine, one model; the two strategies run interleaved round by round, in an order
swapped each round (A-B, B-A), so drift hits both alike; medians and per-round paired ratios
are reported. Preprocessing (decode, resize, patchify) is done once, before timing.

Workload, per round: ``--images`` distinct JPEGs of mixed sizes and aspects (each resized by
Gemma 4's processor within the model's soft tokens, 280 for the ``small`` and ``large``
presets, and padded to that budget) and ``--clips`` distinct MP4 clips (each sampled as Gemma 4's
video processor samples, up to 32 frames, every frame within 70 soft tokens):

* ``loop``: every image through the tower alone, and every video frame alone (one forward per
  image and per frame): what the encoder did before vitserve batched it.
* ``batched``: ``EncoderEngine.run`` over all items: images in their budget's bucket, all
  frames of all clips in theirs, forwards as the planner cuts them under the activation budget
  (and, on a CPU, its cache-sized cap on patches per forward).

Prints images/s, frames/s and items' forwards per strategy (images and frames are timed as
separate sets, so each rate is its own).

    python loadtest/bench_gemma4.py --preset small --depth 4 --dtype bf16
    python loadtest/bench_gemma4.py --preset large --device cuda --dtype bf16 --images 64 --clips 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

STRATEGIES = ("loop", "batched")
SIZES = ((640, 480), (1280, 720), (512, 512), (480, 800), (1920, 1080), (300, 900))
CLIP = (24, 640, 360, 8)  # frames, width, height, fps: 3 s, every frame sampled (24 < 32)


@dataclass
class Result:
    strategy: str
    kind: str  # images or frames
    items: int
    seconds: list[float] = field(default_factory=list)
    forwards: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def per_s(self) -> float:
        return self.items / self.median_s


def clip_bytes(frames: int, width: int, height: int, fps: int, seed: int) -> bytes:
    """An MP4 (H.264) of moving noise blocks, distinct per ``seed``."""
    import io

    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (height // 8, width // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = np.roll(base, i, axis=1).repeat(8, axis=0).repeat(8, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def single_frames(p: Any) -> list[Any]:
    """A prepared video's frames as one-frame items (each frame's pixels, its own grid)."""
    frames, height, width = p.grid
    n = height * width
    return [
        replace(
            p,
            pixels=p.pixels[i * n : (i + 1) * n],
            grid=(1, height, width),
            num_tokens=p.num_tokens // frames,
            patches=p.patches // frames,
            seq_len=p.seq_len // frames,
        )
        for i in range(frames)
    ]


def timed(engine: Any, strategy: str, items: list[Any]) -> tuple[float, int]:
    import torch

    before = engine.counters.forward_calls
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    started = time.perf_counter()
    if strategy == "loop":
        for p in items:
            engine.run([p])
    else:
        engine.run(items)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - started, engine.counters.forward_calls - before


def main() -> None:
    from vitserve.encoder.engine import EncoderEngine
    from vitserve.encoder.video import VideoSampling
    from vitserve.testing.images import make_image
    from vitserve.testing.models import cached_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "large"))
    parser.add_argument("--depth", type=int, default=None, help="tower layers (default: preset)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--images", type=int, default=12)
    parser.add_argument("--clips", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model = str(cached_model("gemma4", args.preset, depth=args.depth))
    engine = EncoderEngine.from_pretrained(model, device=args.device, dtype=args.dtype)
    sampling = VideoSampling(num_frames=32, max_soft_tokens=70)
    images = [
        engine.prepare_one(make_image(w, h, fmt="JPEG", seed=100 + i))
        for i, (w, h) in enumerate(SIZES[i % len(SIZES)] for i in range(args.images))
    ]
    videos = [engine.prepare_video(clip_bytes(*CLIP, seed=k), sampling) for k in range(args.clips)]
    frames = [f for v in videos for f in single_frames(v)]
    sets = {
        "images": {"loop": images, "batched": images},
        "frames": {"loop": frames, "batched": videos},
    }
    results = {
        (kind, s): Result(s, kind, len(sets[kind]["loop"])) for kind in sets for s in STRATEGIES
    }
    engine.run(images[:1])  # warm-up: allocator, kernels, thread pools
    engine.run(frames[:1])
    for r in range(args.rounds):
        for kind in sets:
            for s in STRATEGIES if r % 2 == 0 else STRATEGIES[::-1]:
                seconds, forwards = timed(engine, s, sets[kind][s])
                results[kind, s].seconds.append(seconds)
                results[kind, s].forwards = forwards
                print(f"  round {r} {kind:<6} {s:<7} {seconds:8.2f} s  {forwards} forwards")

    v = engine.adapter.config.vision_config
    print(
        f"\n== gemma4 {args.preset} (tower {v.hidden_size} x {v.num_hidden_layers}) "
        f"{engine.dtype} on {engine.device}; image budget {images[0].patches} patches, "
        f"frame budget {frames[0].patches}; {len(images)} images, {len(videos)} clips of "
        f"{videos[0].grid[0]} frames"
    )
    print(f"{'set':<7} {'strategy':<8} {'median s':>9} {'items/s':>9} {'forwards':>9}")
    for (kind, s), res in results.items():
        print(f"{kind:<7} {s:<8} {res.median_s:9.2f} {res.per_s:9.3f} {res.forwards:9d}")
    for kind in sets:
        loop, batched = results[kind, "loop"], results[kind, "batched"]
        paired = [a / b for a, b in zip(loop.seconds, batched.seconds, strict=True)]
        print(
            f"{kind}: batched / loop throughput {batched.per_s / loop.per_s:.2f}x "
            f"(per round {', '.join(f'{x:.2f}' for x in paired)})"
        )


if __name__ == "__main__":
    main()
