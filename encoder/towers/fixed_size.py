"""Fixed-size towers: LLaVA-style (``Tower.FIXED_SIZE``: CLIP tower, feature layers, MLP
projector; LLaVA, VipLLaVA) and Gemma 3 (``Tower.FIXED_SIZE_POOLED``: SigLIP tower + pooling
projector).

Both processors resize every image to one fixed square, so every image of a model lands in one
bucket and a batch is a plain ``[B, C, H, W]`` stack: no padding, no packing. The projector runs
once over the whole batch's ``[B, seq, width]`` features.

* LLaVA-style: features are the hidden states after ``config.vision_feature_layer`` (an index,
  or a list whose layers are concatenated), with the CLS row dropped for the ``default`` select
  strategy (kept for ``full``; a config without ``vision_feature_select_strategy`` is
  ``default``), then the spec's projector.
* Gemma 3: the SigLIP tower's last hidden state, average-pooled to ``mm_tokens_per_image``
  tokens, normalised and projected by ``multi_modal_projector``. Pan-and-scan crops are not
  supported (refused at load: the spec's ``refused_processor_settings``).

The projector class, the CLS row and the token count are read from the family's spec.
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from PIL import Image

from vitserve.encoder.towers.base import (
    FamilyAdapter,
    ImageFeatures,
    PreparedImage,
    pack_rows,
)
from vitserve.encoder.work import ResizeRule
from vitserve.errors import ModelLoadError
from vitserve.families.spec import FamilySpec, config_value


class FixedSizeAdapter(FamilyAdapter):
    """Shared by towers that see one fixed input size (CLIP, SigLIP)."""

    @classmethod
    def build_modules(cls, spec: FamilySpec, config: Any) -> dict[str, Any]:
        # heavy: the loaders import the adapters and stay torch-free
        from transformers import AutoModel

        assert spec.vision.projector_class is not None  # a fixed-size tower has a projector
        module, name = spec.vision.projector_class
        projector = getattr(importlib.import_module(module), name)(config)
        tower = AutoModel.from_config(config.vision_config, attn_implementation="sdpa")
        return {"tower": tower, "projector": projector}

    def num_tokens(self, patches: int) -> int:
        return patches

    def resize_rule(self) -> ResizeRule:
        """Every image becomes one array of the processor's output size: read off a blank
        image once (no weights needed)."""
        prepared = self.preprocess(Image.new("RGB", (8, 8)), "")
        channels, height, width = prepared.pixels.shape
        return ResizeRule(
            patch_size=int(self.config.vision_config.patch_size),
            channels=int(channels),
            fixed=(int(height), int(width)),
            fixed_tokens=prepared.num_tokens,
        )

    def output_widths(self) -> dict[str, int]:
        # The projector's output: the language model's width.
        return {"embedding": int(config_value(self.config, self.spec.vision.output_width))}

    def preprocess(self, image: Any, key: str) -> PreparedImage:
        out = self.processor(images=[image], return_tensors="np")
        pixels = out["pixel_values"]
        if pixels.shape[0] != 1:
            raise ModelLoadError(
                self.config.model_type, "processor made several crops of one image"
            )
        pixels = pixels[0]  # a view: [C, H, W]
        _, height, width = pixels.shape
        p = self.config.vision_config.patch_size
        patches = (height // p) * (width // p)
        return PreparedImage(
            key=key,
            pixels=pixels,
            grid=None,
            num_tokens=self.num_tokens(patches),
            patches=patches,
            seq_len=patches + int(self.spec.vision.cls_row),
            bucket=(self.config.model_type, height, width),
        )

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch  # heavy: the loaders import the adapters and stay torch-free

        pixels = pack_rows([p.pixels[None] for p in batch], device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            features = self._features(pixels)
        # Per-image rows of the [B, tokens, hidden] output: contiguous views, no copies.
        return [ImageFeatures(tokens=features[i]) for i in range(len(batch))]

    @abstractmethod
    def _features(self, pixels: Any) -> Any:
        """``[B, num_tokens, hidden]`` projected features of a ``[B, C, H, W]`` batch."""


class LlavaAdapter(FixedSizeAdapter):
    @property
    def strategy(self) -> str:
        return getattr(self.config, "vision_feature_select_strategy", "default")

    def num_tokens(self, patches: int) -> int:
        return patches + (1 if self.strategy == "full" else 0)

    def settings(self) -> dict[str, Any]:
        return {
            "family": self.spec.model_type,
            "feature_layer": self.config.vision_feature_layer,
            "select_strategy": self.strategy,
        }

    def _features(self, pixels: Any) -> Any:
        import torch  # heavy: the loaders import the adapters and stay torch-free

        out = self.tower(pixels, output_hidden_states=True, return_dict=True)
        layers = self.config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        drop = 1 if self.strategy == "default" else 0
        selected = [out.hidden_states[i][:, drop:] for i in layers]
        hidden = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.projector(hidden)


class Gemma3Adapter(FixedSizeAdapter):
    @property
    def tokens_per_image(self) -> int:
        return int(getattr(self.config, str(self.spec.placeholders.count)))

    def num_tokens(self, patches: int) -> int:
        return self.tokens_per_image

    def settings(self) -> dict[str, Any]:
        return {"family": self.spec.model_type, "mm_tokens_per_image": self.tokens_per_image}

    def _features(self, pixels: Any) -> Any:
        hidden = self.tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return self.projector(hidden)
