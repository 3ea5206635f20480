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


def _host(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")  # no copy when already on the CPU
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def embedding_record(embedding: Any, fingerprint: str) -> EmbeddingRecord:
    """The store record of an engine ``Embedding`` (see the module's invariants)."""
    tensors = {"embedding": _host(embedding.tensor)}
    tensors |= {name: _host(t) for name, t in embedding.extras.items()}
    return EmbeddingRecord(
        key=embedding.key,
        fingerprint=fingerprint,
        dtype=dtype_name(embedding.tensor.dtype),
        num_tokens=embedding.num_tokens,
        grid=embedding.grid,
        tensors=tensors,
    )
