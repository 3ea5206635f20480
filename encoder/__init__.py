"""vitserve.encoder: the model side (images, family adapters, batching, engine).

Imports torch, transformers, pillow and safetensors; never Ray, Redis or HTTP code. The names
below load lazily, so that importing a light submodule (``planner``, ``images``) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EncoderEngine": "vitserve.encoder.engine",
    "Embedding": "vitserve.encoder.engine",
    "ImageLimits": "vitserve.encoder.images",
    "decode_image": "vitserve.encoder.images",
    "plan_batches": "vitserve.encoder.planner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'vitserve.encoder' has no attribute {name!r}")
