"""Packed variable-resolution towers (``Tower.PACKED``): Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

The processor turns an image into ``t*h*w`` flattened patches and a ``(t, h, w)`` grid; the
tower takes the patches of any number of images concatenated along the sequence, with one grid
row each, and attends within each image only (``cu_seqlens``), so a packed forward is exactly the
per-image forward. Its merger turns every ``merge_size**2`` patches into one LLM token, so an
image yields ``t*h*w / merge_size**2`` tokens. Qwen3-VL also returns one deepstack feature per
tapped layer (same rows), which the LLM adds into its first layers: they are part of the output,
as ``extras["deepstack_<i>"]``.

A video is the same packed input with ``t > 1``: its sampled frames, each preprocessed as an
image is, woven ``temporal_patch_size`` at a time into temporal patches
(:meth:`QwenAdapter.preprocess_video`, what transformers' Qwen video processors make), so its
frames batch with images in one forward.

Buckets: images whose patch counts fall in the same power-of-two class share a bucket. Packing
never pads, so the bucket only keeps a forward's images of similar cost, which keeps a small
image from waiting on a huge one's forward.

What differs between the families is read from their specs (``spec.vision``): the tower class,
the config names of its dimensions, a gated MLP, window attention, the output width's config
path and deepstack features.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vitserve.encoder.towers.base import (
    FamilyAdapter,
    ImageFeatures,
    PreparedImage,
    TowerShape,
    pack_rows,
)
from vitserve.encoder.work import ResizeRule
from vitserve.families.spec import FamilySpec, config_value

if TYPE_CHECKING:
    from vitserve.encoder.video import VideoSampling


class QwenAdapter(FamilyAdapter):
    packs_sequences: ClassVar = True

    @classmethod
    def build_modules(cls, spec: FamilySpec, config: Any) -> dict[str, Any]:
        assert spec.vision.tower_class is not None  # a packed tower names its class
        module_name, class_name = spec.vision.tower_class
        tower_cls = getattr(importlib.import_module(module_name), class_name)
        return {"tower": tower_cls._from_config(config.vision_config, attn_implementation="sdpa")}

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    @property
    def tower_shape(self) -> TowerShape:
        v = self.config.vision_config
        names = self.spec.vision
        width = int(getattr(v, names.width))
        mlp = getattr(v, names.mlp)
        return TowerShape(
            width=width,
            depth=int(getattr(v, names.depth)),
            heads=int(getattr(v, names.heads)),
            mlp=int(width * mlp) if names.mlp_is_ratio else int(mlp),
            mlp_matrices=3 if names.gated_mlp else 2,
            patch_dim=v.in_channels * v.temporal_patch_size * v.patch_size**2,
        )

    def settings(self) -> dict[str, Any]:
        v = self.config.vision_config
        return {
            "family": self.config.model_type,
            "deepstack": list(getattr(v, "deepstack_visual_indexes", None) or []),
        }

    def resize_rule(self) -> ResizeRule:
        p = self.processor
        return ResizeRule(
            patch_size=int(p.patch_size),
            channels=3,
            merge_size=int(p.merge_size),
            temporal_patch_size=int(p.temporal_patch_size),
            min_pixels=int(p.size.shortest_edge),
            max_pixels=int(p.size.longest_edge),
        )

    def output_widths(self) -> dict[str, int]:
        # The merger's width (Qwen2-VL: vision_config.hidden_size; 2.5 and 3: out_hidden_size);
        # Qwen3-VL's deepstack features have the same width.
        width = int(config_value(self.config, self.spec.vision.output_width))
        levels = self._deepstack_levels()
        return {"embedding": width} | {f"deepstack_{j}": width for j in range(levels)}

    def _deepstack_levels(self) -> int:
        if not self.spec.vision.deepstack:
            return 0
        return len(self.config.vision_config.deepstack_visual_indexes or [])

    def preprocess(self, image: Any, key: str) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="np")
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        patches = t * h * w
        return PreparedImage(
            key=key,
            pixels=out["pixel_values"],
            grid=(t, h, w),
            num_tokens=patches // self.merge_size**2,
            patches=patches,
            seq_len=patches,
            bucket=("qwen", patches.bit_length()),
        )

    def preprocess_video(
        self, frames: Iterable[Any], count: int, key: str, sampling: VideoSampling
    ) -> PreparedImage:
        """The video processor's pixels: each of the ``count`` frames resized within the
        video's pixel bounds (per frame; Qwen3-VL's over the whole clip: ``FrameRule``),
        rescaled and normalized as an image is (the image processor), then
        every ``temporal_patch_size`` frames (the last repeated to fill the last group) woven
        into one temporal patch, groups in time order: ``[t*h*w, C*T*P*P]``, grid ``(t, h, w)``.
        Frame by frame: each is written into the video's array as it comes, so the decoded
        frames are never all held."""
        from PIL import Image

        from vitserve.encoder.video import FrameRule

        p = self.processor
        tps, size = int(p.temporal_patch_size), int(p.patch_size)
        bounds = {"shortest_edge": sampling.min_pixels, "longest_edge": sampling.max_pixels}
        # Qwen3-VL sizes the clip's frames together (its bounds over t*h*w): each frame is
        # resized to that size here, then taken as it is
        clip_rule = self.resize_rule().for_frames(
            min_pixels=sampling.min_pixels,
            max_pixels=sampling.max_pixels,
            soft_tokens=0,
            clip=True,
        )
        together = sampling.rule is FrameRule.QWEN3
        t = -(-count // tps)
        woven: np.ndarray | None = None  # [t, h*w, C, tps, P, P], once the first frame is sized
        grid = (0, 0, 0)
        seen = 0
        for i, frame in enumerate(frames):
            image = Image.fromarray(frame)
            if together:
                target = clip_rule.resized_frames(image.width, image.height, count)
                if target is None:
                    raise ValueError(f"a clip of {count} frames of {image.size} is refused")
                if (image.height, image.width) != target:
                    image = image.resize((target[1], target[0]), Image.Resampling.BICUBIC)
                out = p(images=[image], do_resize=False, return_tensors="np")
            else:
                out = p(images=[image], size=bounds, return_tensors="np")
            _, fh, fw = (int(x) for x in out["image_grid_thw"][0])
            this = (1, fh, fw)
            if woven is None:
                grid = this
                woven = np.empty((t, this[1] * this[2], 3, tps, size, size), np.float32)
            elif this != grid:
                raise ValueError(f"frames of one video resized differently: {grid}, {this}")
            # An image's patch holds its frame tps times (C, T, P, P): keep one copy.
            rows = out["pixel_values"].reshape(-1, 3, tps, size, size)[:, :, 0]
            woven[i // tps, :, :, i % tps] = rows
            seen = i + 1
        if woven is None or seen != count:
            raise ValueError(f"{seen} frames decoded of {count} sampled")
        for i in range(count, t * tps):  # the last group filled with the last frame
            woven[i // tps, :, :, i % tps] = woven[(count - 1) // tps, :, :, (count - 1) % tps]
        h, w = grid[1], grid[2]
        patches = t * h * w
        return PreparedImage(
            key=key,
            pixels=woven.reshape(patches, 3 * tps * size * size),
            grid=(t, h, w),
            num_tokens=patches // self.merge_size**2,
            patches=patches,
            seq_len=patches,
            bucket=("qwen", patches.bit_length()),
        )

    def attention_span(self, p: PreparedImage) -> float:
        if not self.spec.vision.window_attention:
            return float(p.seq_len)
        # Qwen2.5-VL attends within windows of window_size pixels in all but its full-attention
        # blocks.
        v = self.config.vision_config
        window = min(p.seq_len, (v.window_size // v.patch_size) ** 2)
        full = len(v.fullatt_block_indexes)
        return (full * p.seq_len + (v.depth - full) * window) / v.depth

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch  # heavy: the loaders import the adapters and stay torch-free

        pixels = pack_rows([p.pixels for p in batch], device=self.device, dtype=self.dtype)
        grid = torch.tensor([p.grid for p in batch], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.tower(pixels, grid_thw=grid)
        sizes = [p.num_tokens for p in batch]
        # torch.split gives row slices of the contiguous outputs: views, no copies.
        tokens = torch.split(out.pooler_output, sizes)
        deepstack = [
            torch.split(f, sizes) for f in (getattr(out, "deepstack_features", None) or [])
        ]
        return [
            ImageFeatures(
                tokens=tokens[i],
                extras={f"deepstack_{j}": feats[i] for j, feats in enumerate(deepstack)},
            )
            for i in range(len(batch))
        ]
