"""The store record of an engine embedding: the one place device tensors become the bytes a
store holds.

The encoder replica publishes what :func:`embedding_record` returns (through the codec's
``encode_record``); tests that check the publish path on a device call it the same way, with no
Ray cluster: this module imports neither Ray nor a store client.

Invariants:

* Every tensor of the embedding (``embedding`` and each extra) is in the record under its name,
  copied to host memory first when it lies on a device; a CPU tensor is viewed, not copied.
* bf16 is stored as its raw 16-bit words (numpy has no bf16), fp16 and fp32 as they are; the
  record's ``dtype`` names the tensor's dtype, so a reader turns the words back bit for bit.
* Key, token count and grid are the embedding's; the fingerprint is the engine's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vitserve.cache.codec import EmbeddingRecord
from vitserve.encoder.device import dtype_name


def host_array(t: torch.Tensor) -> np.ndarray:
    """A tensor's values in host memory as a record stores them (bf16 as raw 16-bit words)."""
    t = t.detach().to("cpu")  # no copy when already on the CPU
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def embedding_record(embedding: Any, fingerprint: str) -> EmbeddingRecord:
    """The store record of an engine ``Embedding`` (see the module's invariants)."""
    tensors = {"embedding": host_array(embedding.tensor)}
    tensors |= {name: host_array(t) for name, t in embedding.extras.items()}
    return EmbeddingRecord(
        key=embedding.key,
        fingerprint=fingerprint,
        dtype=dtype_name(embedding.tensor.dtype),
        num_tokens=embedding.num_tokens,
        grid=embedding.grid,
        tensors=tensors,
        times=getattr(embedding, "times", None),
        frame_rate=getattr(embedding, "frame_rate", None),
    )


def columns_record(
    key: str,
    fingerprint: str,
    tensor: torch.Tensor,
    names: list[str],
    grid: tuple[int, ...] | None = None,
) -> EmbeddingRecord:
    """The store record of an LLM server's encoder output for one item (vLLM's encoder-cache
    tensor: the embedding and its extras side by side along the hidden dim, ``len(names)``
    groups of equal width), under ``key``: each group a tensor of its name, in its dtype."""
    rows, total = int(tensor.shape[0]), int(tensor.shape[-1])
    width = total // len(names) if names else 0
    if not names or width * len(names) != total:
        raise ValueError(f"a [{rows}, {total}] tensor does not split into {len(names)} groups")
    tensors = {
        name: host_array(tensor[:, i * width : (i + 1) * width].contiguous())
        for i, name in enumerate(names)
    }
    return EmbeddingRecord(
        key=key,
        fingerprint=fingerprint,
        dtype=dtype_name(tensor.dtype),
        num_tokens=rows,
        grid=tuple(grid) if grid is not None and len(grid) == 3 else None,  # type: ignore[arg-type]
        tensors=tensors,
    )
