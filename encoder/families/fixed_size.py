"""LLaVA (CLIP tower + MLP projector) and Gemma 3 (SigLIP tower + pooling projector).

Both processors resize every image to one fixed square, so every image of a model lands in one
bucket and a batch is a plain ``[B, C, H, W]`` stack: no padding, no packing. The projector runs
once over the whole batch's ``[B, seq, width]`` features.

* LLaVA: features are the hidden states after ``config.vision_feature_layer`` (an index, or a
  list whose layers are concatenated), with the CLS row dropped for the ``default`` select
  strategy (kept for ``full``), then ``multi_modal_projector``.
* Gemma 3: the SigLIP tower's last hidden state, average-pooled to ``mm_tokens_per_image``
  tokens, normalised and projected by ``multi_modal_projector``. Pan-and-scan crops are not
  supported (refused at load).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from vitserve.encoder.families.base import (
    FamilyAdapter,
    ImageFeatures,
    PreparedImage,
    TowerShape,
    pack_rows,
)
from vitserve.encoder.work import ResizeRule
from vitserve.errors import ModelLoadError

# Hub checkpoints put the tower and projector at the top level (and the tower's weights under
# ``vision_model.``); the in-memory model has them under ``model.`` without ``vision_model.``.
_PREFIXES = {
    "tower": (r"model\.vision_tower\.", r"vision_tower\.vision_model\.", r"vision_tower\."),
    "projector": (r"model\.multi_modal_projector\.", r"multi_modal_projector\."),
}


class FixedSizeAdapter(FamilyAdapter):
    """Shared by towers that see one fixed input size (CLIP, SigLIP)."""

    weight_prefixes: ClassVar = _PREFIXES
    has_cls: ClassVar[bool]
    projector_class: ClassVar[tuple[str, str]]  # (module, class name) in transformers

    @classmethod
    def build_modules(cls, config: Any) -> dict[str, Any]:
        import importlib

        from transformers import AutoModel

        module, name = cls.projector_class
        projector = getattr(importlib.import_module(module), name)(config)
        tower = AutoModel.from_config(config.vision_config, attn_implementation="sdpa")
        return {"tower": tower, "projector": projector}

    @property
    def tower(self) -> Any:
        return self.modules["tower"]

    @property
    def projector(self) -> Any:
        return self.modules["projector"]

    @property
    def tower_shape(self) -> TowerShape:
        v = self.config.vision_config
        return TowerShape(
            width=v.hidden_size,
            depth=v.num_hidden_layers,
            heads=v.num_attention_heads,
            mlp=v.intermediate_size,
            mlp_matrices=2,
            patch_dim=v.num_channels * v.patch_size**2,
        )

    def num_tokens(self, patches: int) -> int:
        return patches

    def resize_rule(self) -> ResizeRule:
        """Every image becomes one array of the processor's output size: read off a blank
        image once (no weights needed)."""
        from PIL import Image

        prepared = self.preprocess(Image.new("RGB", (8, 8)), "")
        channels, height, width = prepared.pixels.shape
        return ResizeRule(patch_size=int(self.config.vision_config.patch_size),
                          channels=int(channels), fixed=(int(height), int(width)),
                          fixed_tokens=prepared.num_tokens)  # fmt: skip

    def output_widths(self) -> dict[str, int]:
        return {"embedding": int(self.config.text_config.hidden_size)}  # the projector's out

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
            seq_len=patches + int(self.has_cls),
            bucket=(self.config.model_type, height, width),
        )

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch

        pixels = pack_rows([p.pixels[None] for p in batch], device=self.device, dtype=self.dtype)
        with torch.inference_mode():
            features = self._features(pixels)
        # Per-image rows of the [B, tokens, hidden] output: contiguous views, no copies.
        return [ImageFeatures(tokens=features[i]) for i in range(len(batch))]

    @abstractmethod
    def _features(self, pixels: Any) -> Any:
        """``[B, num_tokens, hidden]`` projected features of a ``[B, C, H, W]`` batch."""


class LlavaAdapter(FixedSizeAdapter):
    families = ("llava",)
    has_cls = True
    projector_class = ("transformers.models.llava.modeling_llava", "LlavaMultiModalProjector")

    @property
    def strategy(self) -> str:
        return self.config.vision_feature_select_strategy

    def num_tokens(self, patches: int) -> int:
        return patches + (1 if self.strategy == "full" else 0)

    def settings(self) -> dict[str, Any]:
        return {
            "family": "llava",
            "feature_layer": self.config.vision_feature_layer,
            "select_strategy": self.strategy,
        }

    def _features(self, pixels: Any) -> Any:
        import torch

        out = self.tower(pixels, output_hidden_states=True, return_dict=True)
        layers = self.config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        drop = 1 if self.strategy == "default" else 0
        selected = [out.hidden_states[i][:, drop:] for i in layers]
        hidden = selected[0] if len(selected) == 1 else torch.cat(selected, dim=-1)
        return self.projector(hidden)


class Gemma3Adapter(FixedSizeAdapter):
    families = ("gemma3",)
    has_cls = False
    projector_class = ("transformers.models.gemma3.modeling_gemma3", "Gemma3MultiModalProjector")

    @classmethod
    def check_processor(cls, processor: Any) -> None:
        if getattr(processor, "do_pan_and_scan", False):
            raise ModelLoadError("gemma3", "pan-and-scan image processing is not supported")

    def num_tokens(self, patches: int) -> int:
        return int(self.config.mm_tokens_per_image)

    def settings(self) -> dict[str, Any]:
        return {"family": "gemma3", "mm_tokens_per_image": self.config.mm_tokens_per_image}

    def _features(self, pixels: Any) -> Any:
        hidden = self.tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return self.projector(hidden)
