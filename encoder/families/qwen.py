"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: packed variable-resolution towers.

The processor turns an image into ``t*h*w`` flattened patches and a ``(t, h, w)`` grid; the
tower takes the patches of any number of images concatenated along the sequence, with one grid
row each, and attends within each image only (``cu_seqlens``), so a packed forward is exactly the
per-image forward. Its merger turns every ``merge_size**2`` patches into one LLM token, so an
image yields ``t*h*w / merge_size**2`` tokens. Qwen3-VL also returns one deepstack feature per
tapped layer (same rows), which the LLM adds into its first layers: they are part of the output,
as ``extras["deepstack_<i>"]``.

Buckets: images whose patch counts fall in the same power-of-two class share a bucket. Packing
never pads, so the bucket only keeps a forward's images of similar cost, which keeps a small
image from waiting on a huge one's forward.
"""

from __future__ import annotations

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

_TOWER_CLASSES = {
    "qwen2_vl": (
        "transformers.models.qwen2_vl.modeling_qwen2_vl",
        "Qwen2VisionTransformerPretrainedModel",
    ),
    "qwen2_5_vl": (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
        "Qwen2_5_VisionTransformerPretrainedModel",
    ),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
}


class QwenAdapter(FamilyAdapter):
    families = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    # Hub checkpoints of Qwen2/2.5-VL name the tower ``visual.*``; the in-memory model (and
    # Qwen3-VL checkpoints) use ``model.visual.*``.
    weight_prefixes: ClassVar = {"tower": (r"model\.visual\.", r"visual\.")}
    packs_sequences: ClassVar = True

    @classmethod
    def build_modules(cls, config: Any) -> dict[str, Any]:
        import importlib

        module_name, class_name = _TOWER_CLASSES[config.model_type]
        tower_cls = getattr(importlib.import_module(module_name), class_name)
        return {"tower": tower_cls._from_config(config.vision_config, attn_implementation="sdpa")}

    @property
    def tower(self) -> Any:
        return self.modules["tower"]

    @property
    def merge_size(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    @property
    def tower_shape(self) -> TowerShape:
        v = self.config.vision_config
        family = self.config.model_type
        width = v.embed_dim if family == "qwen2_vl" else v.hidden_size
        mlp = int(v.embed_dim * v.mlp_ratio) if family == "qwen2_vl" else v.intermediate_size
        return TowerShape(
            width=width,
            depth=v.depth,
            heads=v.num_heads,
            mlp=mlp,
            mlp_matrices=3 if family == "qwen2_5_vl" else 2,
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
        return ResizeRule(patch_size=int(p.patch_size), channels=3,
                          merge_size=int(p.merge_size),
                          temporal_patch_size=int(p.temporal_patch_size),
                          min_pixels=int(p.size.shortest_edge),
                          max_pixels=int(p.size.longest_edge))  # fmt: skip

    def output_widths(self) -> dict[str, int]:
        v = self.config.vision_config
        # Qwen2-VL's merger projects to the vision config's hidden_size (the LLM's); 2.5 and 3
        # name it out_hidden_size. Qwen3-VL's deepstack features have the same width.
        width = int(v.hidden_size if self.config.model_type == "qwen2_vl" else v.out_hidden_size)
        deepstack = getattr(v, "deepstack_visual_indexes", None) or []
        return {"embedding": width} | {f"deepstack_{j}": width for j in range(len(deepstack))}

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

    def attention_span(self, p: PreparedImage) -> float:
        if self.config.model_type != "qwen2_5_vl":
            return float(p.seq_len)
        # Qwen2.5-VL attends within windows of window_size pixels in all but its full-attention
        # blocks.
        v = self.config.vision_config
        window = min(p.seq_len, (v.window_size // v.patch_size) ** 2)
        full = len(v.fullatt_block_indexes)
        return (full * p.seq_len + (v.depth - full) * window) / v.depth

    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        import torch

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
