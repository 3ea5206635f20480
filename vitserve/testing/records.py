"""Test records for stores and their users: random embeddings in every dtype the encoder emits.

What a batched row read must move (``expected_read_bytes``) is the tests' own:
``tests/store_reads.py``."""

from __future__ import annotations

import secrets

import numpy as np

from vitserve.cache.codec import EmbeddingRecord


def new_key() -> str:
    return secrets.token_hex(32)


def make_record(
    rows: int = 64,
    width: int = 32,
    *,
    dtype: str = "fp32",
    extras: int = 0,
    key: str | None = None,
    fingerprint: str = "f" * 64,
    seed: int = 0,
) -> EmbeddingRecord:
    """A random record; bf16 as raw 16-bit words (as the encoder publishes it)."""
    rng = np.random.default_rng(seed)

    def tensor() -> np.ndarray:
        values = rng.standard_normal((rows, width)).astype(np.float32)
        if dtype == "fp16":
            return values.astype(np.float16)
        if dtype == "bf16":
            return (values.view(np.uint32) >> 16).astype(np.uint16)
        return values

    tensors = {"embedding": tensor()} | {f"deepstack_{i}": tensor() for i in range(extras)}
    return EmbeddingRecord(
        key=key or new_key(),
        fingerprint=fingerprint,
        dtype=dtype,
        num_tokens=rows,
        grid=(1, 2 * rows, 2) if rows else None,
        tensors=tensors,
    )
