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
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from vitserve.encoder.families.base import FamilyAdapter, ImageFeatures, PreparedImage, TowerShape
from vitserve.encoder.work import ResizeRule
from vitserve.errors import ModelLoadError
from vitserve.families.spec import FamilySpec, config_value


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
    def tower(self) -> Any:
        return self.modules["tower"]

    @property
    def projector(self) -> Any:
        return self.modules["projector"]

    @property
    def kernel(self) -> int:
        return int(self.config.vision_config.pooling_kernel_size)

    @property
    def budget(self) -> int:
        """The patches every image is padded to: the processor's ``max_soft_tokens * k**2``."""
        return int(self.processor.max_soft_tokens) * self.kernel**2

    @property
    def tower_shape(self) -> TowerShape:
        v = self.config.vision_config
        return TowerShape(
            width=v.hidden_size,
            depth=v.num_hidden_layers,
            heads=v.num_attention_heads,
            mlp=v.intermediate_size,
            mlp_matrices=3 if self.spec.vision.gated_mlp else 2,
            patch_dim=3 * v.patch_size**2,
        )

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
        out = self.processor(images=[image], return_tensors="np")
        positions = out["image_position_ids"][0]
        valid = int((positions != -1).all(axis=-1).sum())
        if valid == 0 or valid % self.kernel**2:
            raise ModelLoadError(self.spec.model_type, f"processor made {valid} patches")
        height = int(positions[:valid, 1].max()) + 1
        width = int(positions[:valid, 0].max()) + 1
        return PreparedImage(
            key=key,
            pixels=np.array(out["pixel_values"][0, :valid], dtype=np.float32),  # a copy
            grid=(1, height, width),
            num_tokens=valid // self.kernel**2,
            patches=self.budget,
            seq_len=self.budget,
            bucket=(self.spec.model_type, self.budget),
        )

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch  # heavy: the loaders import the adapters and stay torch-free

        budget, dim = self.budget, batch[0].pixels.shape[1]
        pixels = torch.zeros((len(batch), budget, dim), dtype=self.dtype, device=self.device)
        positions = torch.full((len(batch), budget, 2), -1, dtype=torch.long, device=self.device)
        for i, p in enumerate(batch):
            _, height, width = p.grid  # type: ignore[misc]
            rows, cols = torch.meshgrid(
                torch.arange(height, device=self.device),
                torch.arange(width, device=self.device),
                indexing="ij",
            )
            n = height * width
            pixels[i, :n].copy_(torch.from_numpy(p.pixels), non_blocking=True)
            positions[i, :n] = torch.stack([cols, rows], dim=-1).reshape(n, 2)
        with torch.inference_mode():
            # The tower strips the padding: [sum of the images' rows, width], image by image.
            hidden = self.tower(pixel_values=pixels, pixel_position_ids=positions)
            tokens = self.projector(hidden.last_hidden_state)
        return [ImageFeatures(tokens=t) for t in torch.split(tokens, [p.num_tokens for p in batch])]
