"""Test records for stores and their users: random embeddings in every dtype the encoder emits."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np

from vitserve.cache.codec import EmbeddingRecord, read_header


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


def expected_read_bytes(
    store: Any, reads: Sequence[tuple[str, int, int]], first_read: set[str]
) -> int:
    """Bytes a batched row read (``get_rows_many`` of ``reads``, each ``(key, row_start,
    row_end)``) must move, found by reading the records whole from ``store``: per read and
    tensor, its rows widened to whole checksum blocks; plus each key's head where it is read:
    a remote store reads the first 4 KiB of a value whose header the caller has not cached yet
    (``first_read``, updated), a store holding whole values reads each value's header in every
    call."""
    total = 0
    for key, row_start, row_end in reads:
        header = read_header(bytes(store.get_value(key)))
        for t in header.tensors:
            first = row_start // t.block_rows * t.block_rows
            end = min(t.rows, -(-row_end // t.block_rows) * t.block_rows)
            total += (end - first) * t.row_bytes(header.itemsize)
    for key in dict.fromkeys(k for k, _, _ in reads):
        header = read_header(bytes(store.get_value(key)))
        if store.head_is_whole_value:
            total += header.payload_offset
        elif key in first_read:
            first_read.discard(key)
            total += min(4096, header.total_bytes)
    return total
