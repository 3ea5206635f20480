"""What a store's batched row reads must move, worked out from the records read whole: the
tests of the SDK's and the prefill app's reads check their byte counts against it. Test records
are :mod:`vitserve.testing.records`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vitserve.cache.codec import read_header


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
