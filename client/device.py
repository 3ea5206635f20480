"""Moving fetched rows to a torch device (torch is imported here, only when a device is
given)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from vitserve.client.handles import FetchedChunk, ImageHandle


def as_tensor(array: Any, dtype: str, device: Any = None) -> Any:
    """A torch tensor over ``array``'s memory (no copy; bf16 reinterpreted from its raw
    words), moved non-blocking to ``device`` when given (on the CPU: the same memory)."""
    import torch  # heavy, and only for callers that ask for tensors: the client stays light

    with warnings.catch_warnings():  # read-only views: the tensor is never written here
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensor = torch.from_numpy(array)
    if dtype == "bf16":
        tensor = tensor.view(torch.bfloat16)
    return tensor if device is None else tensor.to(device, non_blocking=True)


def to_device(chunk: FetchedChunk, handles: Sequence[ImageHandle], device: Any) -> FetchedChunk:
    """The chunk with every array as a tensor on ``device``."""
    dtypes = [handles[p.image].dtype for p in chunk.pieces]
    embeddings = [as_tensor(a, d, device) for a, d in zip(chunk.embeddings, dtypes, strict=True)]
    extras = [
        {n: as_tensor(a, d, device) for n, a in x.items()}
        for x, d in zip(chunk.extras, dtypes, strict=True)
    ]
    return dataclasses.replace(chunk, embeddings=embeddings, extras=extras)


__all__ = ["as_tensor", "to_device"]
