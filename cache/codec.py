"""The one wire format of a stored embedding: a small msgpack header, then raw little-endian rows.

Layout of a value::

    prefix   16 bytes  magic b"VSEM" | format version u16 | flags u16 | header length u32
                       | payload offset u32
    header   msgpack   key, model fingerprint, dtype, num_tokens, grid, and per tensor: name,
                       shape, offset in the payload, rows per checksum block, block checksums;
                       plus the checksum of the whole payload; a video's record adds
                       ``times``, the time in seconds of each frame its rows were made from,
                       and ``rate``, its sampled frames per second of video (transformers'
                       ``sampled_fps``: Qwen2.5-VL's positions read it)
    header checksum    16 bytes: the checksum of the prefix and header (format version 2)
    padding            zeros up to ``payload offset`` (a multiple of 64)
    payload            the tensors back to back, each starting 64-byte aligned: "embedding"
                       ``[num_tokens, hidden]`` first, then any extras (Qwen3-VL deepstack), each
                       with ``num_tokens`` rows

Invariants:

* Decoding returns numpy arrays that **view** the buffer they were decoded from (read-only); no
  byte of the payload is copied. bf16 travels as raw 16-bit words (numpy ``uint16``, dtype tag
  ``"bf16"``); ``torch.from_numpy(a).view(torch.bfloat16)`` restores it without a copy.
* Rows ``[r0, r1)`` of every tensor can be read without the rest: :func:`row_spans` gives the byte
  spans to fetch (whole checksum blocks), :func:`decode_rows` checks and views them.
* Nothing here unpickles: the header is msgpack of plain types, the payload raw numbers.
* A value whose prefix, header, length, shape, checksum, key or fingerprint does not check out
  raises :class:`~vitserve.errors.RecordFormatError`; stores count it as a miss, never return it.
  No other exception escapes the decoding functions, whatever the bytes (fuzzed in
  ``tests/fuzz/test_codec_properties.py``).
* Every byte a reader relies on is checked: the prefix and header by the header checksum (a
  flipped key, grid, shape or offset is refused, not misread), the payload by its checksums.
  Only the zero padding is not covered, and it carries nothing.
* A video's rows are its frame groups in time order, ``grid[0]`` groups of
  ``num_tokens // grid[0]`` rows each (a Qwen temporal patch of ``temporal_patch`` frames, a
  Gemma 4 frame); ``times`` holds each sampled frame's time, increasing, and the frames of group
  ``g`` are ``times[g * f : (g + 1) * f]`` with ``f = ceil(len(times) / grid[0])``
  (:meth:`Header.frame_groups`). An image's record has no ``times``.
* Values of another format version raise RecordFormatError: a newer one with ``newer_version``
  set (a miss here, kept for newer readers), an older one (version 1 had no header checksum) as
  a plain miss, so it is recomputed.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from vitserve.errors import RecordFormatError

MAGIC = b"VSEM"
FORMAT_VERSION = 2  # 2: the header checksum after the header
PREFIX = struct.Struct("<4sHHII")
ALIGN = 64
BLOCK_BYTES = 256 * 1024  # largest size of one row-range checksum block
# ... and at most this many rows: a prefill chunk that starts or ends inside an image reads at
# most one block too many at each end, so small rows (narrow models) must not make blocks long
BLOCK_ROWS = 16
SUM_BYTES = 16  # bytes per checksum (see _digest)
MAIN = "embedding"
_WORDS_PER_BLOCK = 512  # 4 KiB blocks of 64-bit words inside one checksum

DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),  # raw bf16 words
}


def _digest(data: Any) -> bytes:
    """A 16-byte Fletcher-style checksum of ``data``, at memory speed (~13 GB/s here).

    The data is read as little-endian 64-bit words in blocks of 4 KiB; with ``s_b`` the wrapping
    sum of block ``b``'s words, the checksum is ``(sum of s_b) xor length, sum of (b+1)*s_b``,
    both mod 2**64. It detects every change confined to one word (any flipped bit or byte),
    truncation, and blocks overwritten, lost or moved. It is not a cryptographic hash: it guards
    against accidents (torn or truncated writes, bit rot, a wrong value), which is what a store
    needs; anyone able to write to the store could write a well-formed record anyway. (blake3
    here ran at 2.8 GB/s on one thread, 6 GB/s on two: a third of a Redis GET's time.)
    """
    buf = memoryview(data).cast("B")
    n = len(buf)
    whole = n - n % 8
    words = np.frombuffer(buf, dtype="<u8", count=whole // 8)
    blocks = len(words) // _WORDS_PER_BLOCK
    sums = (
        words[: blocks * _WORDS_PER_BLOCK]
        .reshape(blocks, _WORDS_PER_BLOCK)
        .sum(axis=1, dtype=np.uint64)
    )
    tail = int(words[blocks * _WORDS_PER_BLOCK :].sum(dtype=np.uint64))
    if n % 8:
        tail += int.from_bytes(bytes(buf[whole:]), "little")
    sums = np.append(sums, np.uint64(tail % 2**64))
    s1 = int(sums.sum(dtype=np.uint64)) ^ n
    weights = np.arange(1, len(sums) + 1, dtype=np.uint64)
    s2 = int((sums * weights).sum(dtype=np.uint64))
    return struct.pack("<QQ", s1, s2)


def block_digests(data: Any, step: int) -> bytes:
    """``_digest`` of each ``step``-byte block of ``data`` (the last may be shorter),
    concatenated: the row-range checksums. Whole blocks of whole 4 KiB word blocks are
    summed in one vectorised pass (a per-block call costs ~10 us of numpy overhead, which
    dominated reading a chunk of many small blocks); any other block goes through ``_digest``.
    """
    buf = memoryview(data).cast("B")
    full = len(buf) // step
    words_per_block = step // 8
    if step % (8 * _WORDS_PER_BLOCK) or not full:
        return b"".join(_digest(buf[i : i + step]) for i in range(0, len(buf), step))
    subs = words_per_block // _WORDS_PER_BLOCK
    words = np.frombuffer(buf, dtype="<u8", count=full * words_per_block)
    sums = words.reshape(full, subs, _WORDS_PER_BLOCK).sum(axis=2, dtype=np.uint64)
    # as _digest: (sum of s_b) xor length, sum of (b+1)*s_b; its trailing empty tail adds 0
    s1 = sums.sum(axis=1, dtype=np.uint64) ^ np.uint64(step)
    s2 = (sums * np.arange(1, subs + 1, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)
    out = np.stack([s1, s2], axis=1).astype("<u8").tobytes()
    rest = buf[full * step :]
    return out + (_digest(rest) if len(rest) else b"")


@functools.lru_cache(maxsize=64)
def _sum_weights(subs: int) -> np.ndarray:
    """``[subs, 2]``: column 0 sums the word-block sums, column 1 weighs block b by b+1."""
    return np.stack([np.ones(subs, np.uint64), np.arange(1, subs + 1, dtype=np.uint64)], axis=1)


def blocks_match(data: Any, step: int, expected: bytes) -> bool:
    """Whether ``block_digests(data, step) == expected``, the lean way for a read's chunk: no
    bytes are built, one reduction and one (wrapping) integer matmul per call."""
    buf = memoryview(data).cast("B")
    full = len(buf) // step
    if step % (8 * _WORDS_PER_BLOCK) or full < 1 or len(buf) % step:
        return block_digests(buf, step) == expected
    subs = step // (8 * _WORDS_PER_BLOCK)
    words = np.frombuffer(buf, dtype="<u8").reshape(full, subs, _WORDS_PER_BLOCK)
    got = np.add.reduce(words, axis=2, dtype=np.uint64) @ _sum_weights(subs)
    got[:, 0] ^= np.uint64(step)
    want = np.frombuffer(expected, dtype="<u8")
    return want.size == got.size and bool((got.reshape(-1) == want).all())


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class EmbeddingRecord:
    """One image's embedding as numpy arrays (views of a buffer when decoded).

    ``tensors`` maps names to ``[rows, width]`` arrays of the numpy dtype of ``dtype``;
    ``"embedding"`` is the one the LLM consumes, any others are extras with the same rows.
    A partial record (from a row-range read) holds rows ``[row_start, row_start + rows)``.
    """

    key: str
    fingerprint: str
    dtype: str
    num_tokens: int
    grid: tuple[int, int, int] | None
    tensors: Mapping[str, np.ndarray]
    row_start: int = 0
    times: tuple[float, ...] | None = None  # a video's sampled frames' times (seconds)
    frame_rate: float | None = None  # a video's sampled frames per second of video

    @property
    def embedding(self) -> np.ndarray:
        return self.tensors[MAIN]

    @property
    def extras(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.tensors.items() if k != MAIN}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies in the payload, and its block checksums."""

    name: str
    rows: int
    width: int
    offset: int  # from the start of the payload
    block_rows: int
    sums: bytes  # SUM_BYTES per block

    def row_bytes(self, itemsize: int) -> int:
        return self.width * itemsize


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed header: everything but the payload."""

    version: int
    key: str
    fingerprint: str
    dtype: str
    num_tokens: int
    grid: tuple[int, int, int] | None
    payload_offset: int
    payload_bytes: int
    payload_sum: bytes
    tensors: tuple[TensorInfo, ...] = field(default_factory=tuple)
    times: tuple[float, ...] | None = None  # a video's sampled frames' times (seconds)
    frame_rate: float | None = None  # a video's sampled frames per second of video

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    def frame_groups(self) -> list[FrameGroup]:
        """A video's frame groups in time order, each with its rows and its frames' times
        (see the module's invariants); ``[]`` for an image."""
        return frame_groups(self.num_tokens, self.grid, self.times)

    @property
    def total_bytes(self) -> int:
        return self.payload_offset + self.payload_bytes


@dataclass(frozen=True, slots=True)
class FrameGroup:
    """Rows ``[start, end)`` of a video's record: the frames sampled at ``times`` (seconds)."""

    start: int
    end: int
    times: tuple[float, ...]


def frame_groups(
    num_tokens: int, grid: tuple[int, int, int] | None, times: tuple[float, ...] | None
) -> list[FrameGroup]:
    """The frame groups of a record of ``num_tokens`` rows, ``grid`` and frame ``times``."""
    if times is None or grid is None:
        return []
    groups = grid[0]
    rows, per = num_tokens // groups, -(-len(times) // groups)
    return [
        FrameGroup(g * rows, (g + 1) * rows, tuple(times[g * per : (g + 1) * per]))
        for g in range(groups)
    ]


def _check_times(times: Any, num_tokens: int, grid: Any) -> tuple[float, ...] | None:
    """``times`` as a record may hold them, or RecordFormatError (ValueError on writing)."""
    if times is None:
        return None
    if (
        not isinstance(times, (list, tuple))
        or not times
        or not all(isinstance(t, float) and math.isfinite(t) and t >= 0 for t in times)
        or list(times) != sorted(times)
        or grid is None
        or not 0 < grid[0] <= len(times)
        or num_tokens % grid[0]
        or -(-len(times) // grid[0]) * (grid[0] - 1) >= len(times)
    ):
        raise RecordFormatError("record frame times do not match its rows and grid")
    return tuple(times)


def encode_record(record: EmbeddingRecord) -> memoryview:
    """The value to store for ``record``: one read-only buffer; the payload is copied into it
    once (a store needs one contiguous value)."""
    dtype = DTYPES.get(record.dtype)
    if dtype is None:
        raise ValueError(f"unknown dtype tag {record.dtype!r}; expected one of {sorted(DTYPES)}")
    if MAIN not in record.tensors:
        raise ValueError(f"a record needs a {MAIN!r} tensor")
    names = [MAIN, *sorted(k for k in record.tensors if k != MAIN)]
    arrays = []
    for name in names:
        a = np.asarray(record.tensors[name])
        if a.ndim != 2 or a.shape[0] != record.num_tokens or a.shape[1] < 1:
            raise ValueError(f"tensor {name!r} has shape {a.shape}; expected [num_tokens, width]")
        if a.dtype.kind != dtype.kind or a.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"tensor {name!r} is {a.dtype}, not {record.dtype}")
        arrays.append(np.ascontiguousarray(a, dtype=dtype))  # no copy when already so

    # Block checksums straight from the arrays (for row-range reads); the whole payload's
    # checksum (for full reads) once the payload is assembled.
    entries, offset = [], 0
    for name, a in zip(names, arrays, strict=True):
        raw = a.reshape(-1).view(np.uint8)
        row_bytes = max(1, a.shape[1] * dtype.itemsize)
        block_rows = max(1, min(BLOCK_ROWS, BLOCK_BYTES // row_bytes))
        step = block_rows * row_bytes
        sums = block_digests(raw, step)
        end = _align(offset + a.nbytes)
        entries.append(
            {
                "name": name,
                "shape": list(a.shape),
                "offset": offset,
                "block_rows": block_rows,
                "sums": sums,
            }
        )
        offset = end
    try:
        times = _check_times(record.times, record.num_tokens, record.grid)
    except RecordFormatError as exc:
        raise ValueError(str(exc)) from None
    doc = {
        "key": record.key,
        "fp": record.fingerprint,
        "dtype": record.dtype,
        "tokens": record.num_tokens,
        "grid": list(record.grid) if record.grid is not None else None,
        "tensors": entries,
        "sum": bytes(SUM_BYTES),  # placeholder of the final size, so the header size is known
    }
    if times is not None:
        rate = record.frame_rate
        if rate is None or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"a video's record needs its frame rate, got {rate!r}")
        doc["times"], doc["rate"] = list(times), float(rate)
    payload_offset = _align(PREFIX.size + len(msgpack.packb(doc)) + SUM_BYTES)
    out = bytearray(payload_offset + offset)
    body = np.frombuffer(out, dtype=np.uint8)
    for entry, a in zip(entries, arrays, strict=True):
        start = payload_offset + entry["offset"]
        body[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    doc["sum"] = _digest(memoryview(out)[payload_offset:])
    _write_head(out, msgpack.packb(doc), payload_offset)
    return memoryview(out).toreadonly()


def _write_head(out: bytearray, header: bytes, payload_offset: int) -> None:
    """The prefix, ``header`` (msgpack) and the checksum of both, at the start of ``out``."""
    PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, 0, len(header), payload_offset)
    end = PREFIX.size + len(header)
    out[PREFIX.size : end] = header
    out[end : end + SUM_BYTES] = _digest(memoryview(out)[:end])


def header_bytes_needed(prefix: bytes | bytearray | memoryview | np.ndarray) -> int:
    """How many bytes from the start hold the prefix, header and header checksum (from the
    16-byte prefix)."""
    _, _, header_len = _parse_prefix(prefix)
    return PREFIX.size + header_len + SUM_BYTES


def _parse_prefix(buf: Any) -> tuple[int, int, int]:
    if len(buf) < PREFIX.size:
        raise RecordFormatError(f"value of {len(buf)} bytes is shorter than the record prefix")
    magic, version, _flags, header_len, payload_offset = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordFormatError("not a vitserve record (bad magic)")
    if version > FORMAT_VERSION:
        raise RecordFormatError(
            f"written by format version {version}; this reader knows up to {FORMAT_VERSION}",
            newer_version=True,
        )
    if version < FORMAT_VERSION:
        raise RecordFormatError(f"format version {version} is no longer read (recompute)")
    return version, payload_offset, header_len


def read_header(buf: Any) -> Header:
    """Parse the prefix and header at the start of ``buf`` (which may hold only those bytes,
    :func:`header_bytes_needed` of them), after checking the header checksum."""
    version, payload_offset, header_len = _parse_prefix(buf)
    end = PREFIX.size + header_len
    if len(buf) < end + SUM_BYTES or payload_offset < end + SUM_BYTES:
        raise RecordFormatError("truncated record header")
    view = memoryview(buf).cast("B")
    if _digest(view[:end]) != view[end : end + SUM_BYTES]:
        raise RecordFormatError("header checksum mismatch")
    try:
        doc = msgpack.unpackb(view[PREFIX.size : end], raw=False)
    except Exception as exc:  # msgpack errors, bad UTF-8; the writer never makes these
        raise RecordFormatError(f"unreadable record header: {type(exc).__name__}: {exc}") from None
    return _parse_header(doc, version, payload_offset)


def _field(doc: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    """``doc[name]``, which must be a ``kind`` (an int: not a bool, not negative)."""
    if not isinstance(doc, dict) or name not in doc:
        raise RecordFormatError(f"record header has no {name!r}")
    value = doc[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RecordFormatError(f"record header field {name!r} is a {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise RecordFormatError(f"record header field {name!r} is negative")
    return value


def _parse_header(doc: Any, version: int, payload_offset: int) -> Header:
    """The Header of a decoded msgpack document, every field type- and range-checked (the
    checksum already vouches for it; this keeps a bug in a writer from becoming a misread)."""
    dtype = _field(doc, "dtype", str)
    if dtype not in DTYPES:
        raise RecordFormatError(f"unknown dtype tag {dtype[:16]!r}")
    itemsize = DTYPES[dtype].itemsize
    num_tokens = _field(doc, "tokens", int)
    grid = _field(doc, "grid", (list, type(None)))
    if grid is not None:
        grid = tuple(_field({"grid": g}, "grid", int) for g in grid)
        if len(grid) != 3:
            raise RecordFormatError("record grid is not (t, h, w)")
    tensors, end = [], 0
    for entry in _field(doc, "tensors", list):
        name = _field(entry, "name", str)
        shape = _field(entry, "shape", list)
        if len(shape) != 2:
            raise RecordFormatError(f"tensor {name!r} is not 2-D")
        rows, width = (_field({"shape": n}, "shape", int) for n in shape)
        info = TensorInfo(
            name=name,
            rows=rows,
            width=width,
            offset=_field(entry, "offset", int),
            block_rows=_field(entry, "block_rows", int),
            sums=_field(entry, "sums", bytes),
        )
        blocks = -(-rows // info.block_rows) if info.block_rows else -1
        if (
            rows != num_tokens
            or width < 1
            or blocks < 0
            or len(info.sums) != blocks * SUM_BYTES
            or info.offset % ALIGN
            or info.offset < end
        ):
            raise RecordFormatError(f"tensor {name!r} does not match the header")
        end = _align(info.offset + rows * width * itemsize)
        tensors.append(info)
    if not tensors or tensors[0].name != MAIN:
        raise RecordFormatError("record has no embedding tensor")
    if len({t.name for t in tensors}) != len(tensors):
        raise RecordFormatError("record names a tensor twice")
    payload_sum = _field(doc, "sum", bytes)
    if len(payload_sum) != SUM_BYTES or payload_offset % ALIGN:
        raise RecordFormatError("record payload checksum or offset is malformed")
    times = _check_times(doc.get("times"), num_tokens, grid)
    rate = doc.get("rate")
    if (times is None) != (rate is None) or not (
        rate is None or (isinstance(rate, float) and math.isfinite(rate) and rate > 0)
    ):
        raise RecordFormatError("record frame rate does not match its frame times")
    return Header(
        version=version,
        key=_field(doc, "key", str),
        fingerprint=_field(doc, "fp", str),
        dtype=dtype,
        num_tokens=num_tokens,
        grid=grid,
        payload_offset=payload_offset,
        payload_bytes=end,
        payload_sum=payload_sum,
        tensors=tuple(tensors),
        times=times,
        frame_rate=rate,
    )


def _check_identity(header: Header, key: str | None, fingerprint: str | None) -> None:
    if key is not None and header.key != key:
        raise RecordFormatError(f"record holds key {header.key[:16]}.., not {key[:16]}..")
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise RecordFormatError("record was made by another model (fingerprint differs)")


def _view(buf: Any, dtype: np.dtype, offset: int, rows: int, width: int) -> np.ndarray:
    a = np.frombuffer(buf, dtype=dtype, count=rows * width, offset=offset).reshape(rows, width)
    a.flags.writeable = False
    return a


def _record(header: Header, tensors: dict[str, np.ndarray], row_start: int = 0) -> EmbeddingRecord:
    return EmbeddingRecord(
        key=header.key,
        fingerprint=header.fingerprint,
        dtype=header.dtype,
        num_tokens=header.num_tokens,
        grid=header.grid,
        tensors=tensors,
        row_start=row_start,
        times=header.times,
        frame_rate=header.frame_rate,
    )


def decode_record(
    buf: Any, *, key: str | None = None, fingerprint: str | None = None, verify: bool = True
) -> EmbeddingRecord:
    """The record in ``buf``, its arrays viewing ``buf``; RecordFormatError if it is not valid.

    ``key``/``fingerprint``, when given, must match the header. ``verify`` checks the payload
    checksum (skip it only for buffers this process wrote itself).
    """
    header = read_header(buf)
    _check_identity(header, key, fingerprint)
    if len(buf) != header.total_bytes:
        raise RecordFormatError(f"record is {len(buf)} bytes; its header says {header.total_bytes}")
    payload = memoryview(buf)[header.payload_offset :]
    if verify and _digest(payload) != header.payload_sum:
        raise RecordFormatError("payload checksum mismatch")
    dtype = DTYPES[header.dtype]
    tensors = {
        t.name: _view(buf, dtype, header.payload_offset + t.offset, t.rows, t.width)
        for t in header.tensors
    }
    return _record(header, tensors)


@dataclass(frozen=True, slots=True)
class RowSpan:
    """Bytes ``[start, end)`` of a value holding rows ``[first_row, end_row)`` of one tensor
    (whole checksum blocks)."""

    tensor: str
    start: int
    end: int
    first_row: int
    end_row: int


def row_spans(header: Header, r0: int, r1: int) -> list[RowSpan]:
    """The byte spans to read for rows ``[r0, r1)`` of every tensor, widened to whole blocks."""
    if not 0 <= r0 < r1 <= header.num_tokens:
        raise ValueError(f"row range [{r0}, {r1}) is outside [0, {header.num_tokens})")
    spans = []
    for t in header.tensors:
        first = r0 // t.block_rows * t.block_rows
        end = min(t.rows, -(-r1 // t.block_rows) * t.block_rows)
        row_bytes = t.row_bytes(header.itemsize)
        base = header.payload_offset + t.offset
        spans.append(RowSpan(t.name, base + first * row_bytes, base + end * row_bytes, first, end))
    return spans


def decode_rows(
    header: Header,
    chunks: Sequence[Any],
    r0: int,
    r1: int,
    *,
    key: str | None = None,
    fingerprint: str | None = None,
    verify: bool = True,
    spans: Sequence[RowSpan] | None = None,
) -> EmbeddingRecord:
    """A partial record of rows ``[r0, r1)`` from the bytes of :func:`row_spans` (``spans``,
    when the caller has them), in order.

    Each chunk's blocks are checked against the header's block checksums; the arrays view the
    chunks.
    """
    _check_identity(header, key, fingerprint)
    spans = spans if spans is not None else row_spans(header, r0, r1)
    if len(chunks) != len(spans):
        raise RecordFormatError(f"expected {len(spans)} row chunks, got {len(chunks)}")
    dtype = DTYPES[header.dtype]
    tensors = {}
    for t, span, chunk in zip(header.tensors, spans, chunks, strict=True):
        if len(chunk) != span.end - span.start:
            raise RecordFormatError(f"truncated rows of tensor {t.name!r}")
        row_bytes = t.row_bytes(header.itemsize)
        if verify:
            first = span.first_row // t.block_rows * SUM_BYTES
            blocks = -(-(span.end_row - span.first_row) // t.block_rows)
            expected = t.sums[first : first + blocks * SUM_BYTES]
            if not blocks_match(chunk, t.block_rows * row_bytes, expected):
                raise RecordFormatError(f"checksum mismatch in rows of tensor {t.name!r}")
        skip = (r0 - span.first_row) * row_bytes
        tensors[t.name] = _view(chunk, dtype, skip, r1 - r0, t.width)
    return _record(header, tensors, r0)


_BUNDLE = struct.Struct("<4sI")  # magic, record count; then a u64 length per record (0: none)
BUNDLE_MAGIC = b"VSRB"


def pack_records(records: Sequence[Any]) -> bytes:
    """Several records (or None for a miss) as one body: the row routes' answer for a batch of
    reads. Layout: ``b"VSRB"``, u32 count, a u64 length per record (0 for None), the records
    back to back."""
    lengths = [0 if r is None else len(r) for r in records]
    head = _BUNDLE.pack(BUNDLE_MAGIC, len(records)) + struct.pack(f"<{len(records)}Q", *lengths)
    return b"".join([head, *(bytes(r) for r in records if r is not None)])


def unpack_records(body: Any) -> list[memoryview | None]:
    """The records of :func:`pack_records`' body, as views of it (no copy); RecordFormatError
    if the body is not such a bundle."""
    view = memoryview(body).cast("B")
    if len(view) < _BUNDLE.size:
        raise RecordFormatError("record bundle shorter than its prefix")
    magic, count = _BUNDLE.unpack_from(view, 0)
    pos = _BUNDLE.size + 8 * count
    if magic != BUNDLE_MAGIC or len(view) < pos:
        raise RecordFormatError("not a record bundle")
    out: list[memoryview | None] = []
    for n in struct.unpack_from(f"<{count}Q", view, _BUNDLE.size):
        out.append(view[pos : pos + n] if n else None)
        pos += n
    if pos != len(view):
        raise RecordFormatError(f"record bundle is {len(view)} bytes; its lengths say {pos}")
    return out
