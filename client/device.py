"""Moving fetched rows to a torch device: on a CUDA device, staged through pinned host memory
so that the copy is really non-blocking.

The rows a fetch returns are numpy views of the fetched bytes: pageable memory, owned by the
store's client. A ``tensor.to("cuda", non_blocking=True)`` from pageable memory is not
asynchronous: CUDA stages pageable memory through a buffer of the driver's and may hold the
host thread until the copy can run, behind every kernel already queued on the stream (the
LLM's prefill), so the prefill loop would stall on each chunk. Each array is therefore copied
once on the host into page-locked memory from torch's pinned allocator
(``Tensor.pin_memory()``), and that copy is queued to the device with ``non_blocking=True``;
the host goes on at once (tests/client/test_cuda_fetch.py checks it behind a long kernel).

Invariants:

* No device: numpy views, no copy (not this module). ``device="cpu"``: tensors over the same
  memory, no copy (bf16 reinterpreted from its raw words, never converted).
* CUDA: one host copy into pinned memory and one asynchronous host-to-device copy per array;
  the caller's arrays (the fetched bytes) are read only before ``to_device`` returns, so the
  store may reuse them at once.
* The pinned buffer outlives its copy without anyone holding it: it comes from torch's caching
  host allocator, and a non-blocking copy from it records an event on the copy's stream; the
  allocator does not reuse the block before that event has passed (pytorch/pytorch#130785:
  dropping the pinned tensor right after ``.to(..., non_blocking=True)`` is safe). Nothing
  here writes to a pinned buffer after its copy is queued. (Memory pinned any other way, such
  as ``cudaHostRegister`` of the fetched bytes, would carry no such guarantee: not done here.)
* Stream order: each copy is queued on the calling thread's current stream of the device. Work
  queued after it on that stream sees the rows; work on another stream must wait for it first
  (``other.wait_stream(stream)``). The sync client's read-ahead (``iter_chunks``) fetches in a
  worker thread, whose current stream is the device's default stream.
* Other devices (``mps``, ``xpu``, ...): a plain ``.to(device, non_blocking=True)``.

torch is imported inside the functions only, when a device is given: the client stays light.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from vitserve.client.handles import FetchedChunk, ImageHandle


def as_tensor(array: Any, dtype: str, device: Any = None) -> Any:
    """A torch tensor of ``array`` (bf16 reinterpreted from its raw words) on ``device``:
    over ``array``'s memory without a device or on the CPU; on a CUDA device, copied
    non-blocking from a pinned staging copy (see the module's invariants)."""
    import torch  # heavy, and only for callers that ask for tensors: the client stays light

    with warnings.catch_warnings():  # read-only views: the tensor is never written here
        warnings.filterwarnings("ignore", message=".*not writable.*")
        tensor = torch.from_numpy(array)
    if dtype == "bf16":
        tensor = tensor.view(torch.bfloat16)
    if device is None:
        return tensor
    target = torch.device(device)
    if target.type == "cuda":
        # The staging copy is dropped on return: the caching host allocator keeps its block
        # until the copy's stream event has passed (module docstring).
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target, non_blocking=True)


def to_device(chunk: FetchedChunk, handles: Sequence[ImageHandle], device: Any) -> FetchedChunk:
    """The chunk with every array as a tensor on ``device`` (:func:`as_tensor`)."""
    dtypes = [handles[p.image].dtype for p in chunk.pieces]
    embeddings = [as_tensor(a, d, device) for a, d in zip(chunk.embeddings, dtypes, strict=True)]
    extras = [
        {n: as_tensor(a, d, device) for n, a in x.items()}
        for x, d in zip(chunk.extras, dtypes, strict=True)
    ]
    return dataclasses.replace(chunk, embeddings=embeddings, extras=extras)


__all__ = ["as_tensor", "to_device"]
