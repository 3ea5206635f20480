"""Towers under a patch budget (``Tower.PADDED_POOLED``): Gemma 4.

The processor resizes each image, aspect kept, to at most ``budget`` patches (``max_soft_tokens
* k**2``, sides in multiples of ``k`` patches, ``k`` the pooling kernel), patchifies it and pads
it to the budget with position ``(-1, -1)``. The tower masks the padding out of attention and
out of its ``k x k`` average pooling, and drops its rows: an image yields its valid patches over
``k**2`` tokens. ``embed_vision`` (norm and projection) then runs once over the rows of the
whole batch, as ``get_image_features`` runs it over its images' rows.

Invariants:

* Every image of a model runs the whole budget: a forward stacks ``[B, budget, patch]`` with
  each image's padding exactly the processor's, so each image's values are those of its
  forward alone (its valid rows attend to its valid rows only). One bucket per model: images
  of one budget share a forward whatever their size.
* A prepared image holds its valid patches only (``[n, 3*p*p]``, a copy: the padded array is
  not kept) and its grid ``(1, height, width)`` in patches; the forward rebuilds its positions
  (row-major, ``(x, y)``) and its padding.
* A video is its sampled frames, each an image within the video's soft tokens (Gemma 4's video
  processor: 70) and padded to that budget: one item of grid ``(frames, height, width)`` (a
  video's frames share a size), in the bucket of that budget, one tower row per frame; its
  rows are its frames' rows in time order (``get_video_features``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vitserve.encoder.towers.base import FamilyAdapter, ImageFeatures, PreparedImage
from vitserve.encoder.work import ResizeRule
from vitserve.errors import ModelLoadError
from vitserve.families.spec import FamilySpec, config_value

if TYPE_CHECKING:
    from vitserve.encoder.video import VideoSampling


def _resolve(name: tuple[str, str] | None) -> Any:
    assert name is not None  # a budget tower names its tower and projector classes
    module, cls = name
    return getattr(importlib.import_module(module), cls)


class Gemma4Adapter(FamilyAdapter):
    @classmethod
    def build_modules(cls, spec: FamilySpec, config: Any) -> dict[str, Any]:
        tower = _resolve(spec.vision.tower_class)._from_config(
            config.vision_config, attn_implementation="sdpa"
        )
        projector = _resolve(spec.vision.projector_class)(
            config.vision_config, config.get_text_config()
        )
        return {"tower": tower, "projector": projector}

    @property
    def kernel(self) -> int:
        return int(self.config.vision_config.pooling_kernel_size)

    @property
    def budget(self) -> int:
        """The patches every image is padded to: the processor's ``max_soft_tokens * k**2``."""
        return int(self.processor.max_soft_tokens) * self.kernel**2

    @classmethod
    def check_processor(cls, spec: FamilySpec, processor: Any) -> None:
        super().check_processor(spec, processor)
        if not getattr(processor, "do_resize", True):
            raise ModelLoadError(spec.model_type, "an image processor without resizing")

    def settings(self) -> dict[str, Any]:
        # From the config alone (an LLM server computes it without the processor); the budget
        # (``max_soft_tokens``) is the processor's, in the fingerprint with its settings.
        return {"family": self.spec.model_type, "kernel": self.kernel}

    def resize_rule(self) -> ResizeRule:
        return ResizeRule(
            patch_size=int(self.processor.patch_size),
            channels=3,
            merge_size=self.kernel,
            budget_patches=self.budget,
        )

    def output_widths(self) -> dict[str, int]:
        return {"embedding": int(config_value(self.config, self.spec.vision.output_width))}

    def preprocess(self, image: Any, key: str) -> PreparedImage:
        soft = int(self.processor.max_soft_tokens)
        pixels, height, width = self._patches(image, soft)
        return self._prepared(key, pixels, 1, height, width, soft)

    def preprocess_video(
        self, frames: Iterable[Any], count: int, key: str, sampling: VideoSampling
    ) -> PreparedImage:
        """Each of the ``count`` sampled frames as an image within ``sampling.max_soft_tokens``
        (the video processor's 70), written into the video's array as it comes: frames of one
        video share a size, so one item of grid ``(frames, h, w)`` whose frames pad to that
        budget each."""
        if not sampling.max_soft_tokens:
            raise ValueError("Gemma 4 samples videos with max_soft_tokens set")
        soft = sampling.max_soft_tokens
        out: np.ndarray | None = None
        size = (0, 0)
        seen = 0
        for i, frame in enumerate(frames):
            pixels, height, width = self._patches(frame, soft)
            if out is None:
                size = (height, width)
                out = np.empty((count, *pixels.shape), np.float32)
            elif (height, width) != size:
                raise ValueError(
                    f"frames of one video resized differently: {size}, {height, width}"
                )
            out[i] = pixels
            seen = i + 1
        if out is None or seen != count:
            raise ValueError(f"{seen} frames decoded of {count} sampled")
        return self._prepared(key, out.reshape(-1, out.shape[-1]), count, *size, soft)

    def _patches(self, image: Any, soft_tokens: int) -> tuple[np.ndarray, int, int]:
        """One image's valid patches (a copy: the padded array is not kept) and its size in
        patches."""
        from PIL import Image

        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        out = self.processor(images=[image], max_soft_tokens=soft_tokens, return_tensors="np")
        positions = out["image_position_ids"][0]
        count = int((positions != -1).all(axis=-1).sum())
        if count == 0 or count % self.kernel**2:
            raise ModelLoadError(self.spec.model_type, f"processor made {count} patches")
        height = int(positions[:count, 1].max()) + 1
        width = int(positions[:count, 0].max()) + 1
        return np.array(out["pixel_values"][0, :count], dtype=np.float32), height, width

    def _prepared(
        self, key: str, pixels: np.ndarray, frames: int, height: int, width: int, soft: int
    ) -> PreparedImage:
        budget = soft * self.kernel**2
        return PreparedImage(
            key=key,
            pixels=pixels,
            grid=(frames, height, width),
            num_tokens=frames * height * width // self.kernel**2,
            patches=frames * budget,
            seq_len=frames * budget,
            bucket=(self.spec.model_type, budget),
        )

    def attention_span(self, p: PreparedImage) -> float:
        # Each frame (an image: one) attends within its own padded budget.
        return float(p.seq_len // p.grid[0]) if p.grid else float(p.seq_len)

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch  # heavy: the loaders import the adapters and stay torch-free

        # One bucket: one budget (the images' or a video's frames'); one row per frame.
        budget, dim = int(batch[0].bucket[1]), batch[0].pixels.shape[1]  # type: ignore[index]
        frames = sum(int(p.grid[0]) if p.grid else 1 for p in batch)
        pixels = torch.zeros((frames, budget, dim), dtype=self.dtype, device=self.device)
        positions = torch.full((frames, budget, 2), -1, dtype=torch.long, device=self.device)
        row = 0
        for p in batch:
            count, height, width = p.grid  # type: ignore[misc]
            rows, cols = torch.meshgrid(
                torch.arange(height, device=self.device),
                torch.arange(width, device=self.device),
                indexing="ij",
            )
            n = height * width
            pixels[row : row + count, :n].copy_(
                torch.from_numpy(p.pixels).view(count, n, dim), non_blocking=True
            )
            positions[row : row + count, :n] = torch.stack([cols, rows], dim=-1).reshape(n, 2)
            row += count
        with torch.inference_mode():
            # The tower strips the padding: [sum of the images' rows, width], image by image.
            hidden = self.tower(pixel_values=pixels, pixel_position_ids=positions)
            tokens = self.projector(hidden.last_hidden_state)
        return [ImageFeatures(tokens=t) for t in torch.split(tokens, [p.num_tokens for p in batch])]
