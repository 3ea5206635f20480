"""The torch side of the model families: one adapter per kind of tower, behind
:class:`FamilyAdapter`.

What a family is (its tower kind, classes, checkpoint prefixes, dimensions' names) is its spec
in :mod:`vitserve.families`; the adapters here are the torch code of each
:class:`~vitserve.families.spec.Tower` kind and read the rest from the spec. A new family whose
tower is one of these kinds needs no code here.
"""

from __future__ import annotations

from vitserve.encoder.towers.base import FamilyAdapter, ImageFeatures, PreparedImage
from vitserve.encoder.towers.budget import Gemma4Adapter
from vitserve.encoder.towers.fixed_size import Gemma3Adapter, LlavaAdapter
from vitserve.encoder.towers.qwen import QwenAdapter
from vitserve.families import family_spec
from vitserve.families.spec import Tower

ADAPTERS: dict[Tower, type[FamilyAdapter]] = {
    Tower.PACKED: QwenAdapter,
    Tower.FIXED_SIZE: LlavaAdapter,
    Tower.FIXED_SIZE_POOLED: Gemma3Adapter,
    Tower.PADDED_POOLED: Gemma4Adapter,
}


def adapter_class(model_type: str, *, model: str = "") -> type[FamilyAdapter]:
    """The adapter for a transformers ``model_type`` (its spec's tower kind);
    UnsupportedModelError if vitserve has no spec for it."""
    return ADAPTERS[family_spec(model_type, model=model).vision.tower]


__all__ = ["ADAPTERS", "FamilyAdapter", "ImageFeatures", "PreparedImage", "adapter_class"]
