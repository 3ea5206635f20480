"""Model-family adapters: one per family, all behind :class:`FamilyAdapter`."""

from __future__ import annotations

from vitserve.encoder.families.base import FamilyAdapter, ImageFeatures, PreparedImage
from vitserve.encoder.families.fixed_size import Gemma3Adapter, LlavaAdapter
from vitserve.encoder.families.qwen import QwenAdapter
from vitserve.errors import UnsupportedModelError

ADAPTERS: dict[str, type[FamilyAdapter]] = {
    family: adapter
    for adapter in (QwenAdapter, LlavaAdapter, Gemma3Adapter)
    for family in adapter.families
}


def adapter_class(model_type: str, *, model: str = "") -> type[FamilyAdapter]:
    """The adapter for a transformers ``model_type``; UnsupportedModelError if there is none."""
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            model or model_type,
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ADAPTERS))}",
        ) from None


__all__ = ["ADAPTERS", "FamilyAdapter", "ImageFeatures", "PreparedImage", "adapter_class"]
