"""Property-based tests (hypothesis) of the record codec and the record bundle.

Properties:

* every valid record (each dtype, any shape, extras, grid, key, arbitrary bit patterns, NaNs
  included) round-trips bit for bit, whole, by row range and inside a bundle;
* every damaged value (truncated, a byte flipped in the prefix, header or payload, another
  format version, trailing bytes, a damaged bundle) raises RecordFormatError, the one error the
  stores treat as a miss; nothing else escapes and no record with other data is accepted (a
  flip in padding no check covers may decode, but only to the very same record).
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.budget import examples
from vitserve.cache.codec import (
    DTYPES,
    FORMAT_VERSION,
    MAIN,
    PREFIX,
    SUM_BYTES,
    EmbeddingRecord,
    _align,
    _write_head,
    decode_record,
    decode_rows,
    encode_record,
    header_bytes_needed,
    pack_records,
    read_header,
    row_spans,
    unpack_records,
)
from vitserve.errors import RecordFormatError

# 1000 per property at full budget (tests/fuzz/budget.py: make test draws a fifth)
EXAMPLES = examples(1000)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

_names = st.text(min_size=1, max_size=12).filter(lambda s: s != MAIN)


@st.composite
def records(draw: st.DrawFn) -> EmbeddingRecord:
    """A valid record: any dtype, 0-40 rows (several checksum blocks), widths that make both
    short and whole-4-KiB blocks, 0-3 extras, raw random bits (NaNs and infinities included)."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    rows = draw(st.integers(0, 40))
    np_dtype = DTYPES[dtype]
    names = [MAIN, *draw(st.lists(_names, max_size=3, unique=True))]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tensors = {}
    for name in names:
        width = draw(st.sampled_from([1, 3, 17, 64, 128, 130]))
        raw = rng.integers(0, 256, rows * width * np_dtype.itemsize, dtype=np.uint8)
        tensors[name] = raw.view(np_dtype).reshape(rows, width)
    grid = draw(st.none() | st.tuples(*[st.integers(0, 2**40)] * 3))
    return EmbeddingRecord(
        key=draw(st.text(max_size=70)),
        fingerprint=draw(st.text(max_size=70)),
        dtype=dtype,
        num_tokens=rows,
        grid=grid,
        tensors=tensors,
    )


def same_record(
    got: EmbeddingRecord, want: EmbeddingRecord, r0: int = 0, r1: int | None = None
) -> bool:
    """Every field equal and every tensor (rows ``[r0, r1)``) equal bit for bit."""
    if (got.key, got.fingerprint, got.dtype, got.num_tokens, got.grid, got.row_start) != (
        want.key,
        want.fingerprint,
        want.dtype,
        want.num_tokens,
        want.grid,
        r0,
    ):
        return False
    if list(got.tensors) != [MAIN, *sorted(n for n in want.tensors if n != MAIN)]:
        return False
    for name, array in got.tensors.items():
        expected = np.asarray(want.tensors[name])[r0:r1]
        if array.dtype != expected.dtype or array.shape != expected.shape:
            return False
        if array.tobytes() != expected.tobytes():
            return False
    return True


def test_valid_records_round_trip_exactly(reliability: Any) -> None:
    counts: Counter = Counter()

    @FUZZ
    @given(record=records(), data=st.data())
    def prop(record: EmbeddingRecord, data: st.DataObject) -> None:
        counts["tried"] += 1
        value = encode_record(record)
        status, decoded = _outcome(
            decode_record, value, key=record.key, fingerprint=record.fingerprint
        )
        counts["lost"] += status != "ok"
        assert status == "ok", decoded
        counts["wrong"] += not same_record(decoded, record)
        assert same_record(decoded, record)
        header = read_header(value[: header_bytes_needed(value[: PREFIX.size])])
        assert header.total_bytes == len(value)
        if record.num_tokens:
            r0 = data.draw(st.integers(0, record.num_tokens - 1))
            r1 = data.draw(st.integers(r0 + 1, record.num_tokens))
            spans = row_spans(header, r0, r1)
            part = decode_rows(
                header,
                [value[s.start : s.end] for s in spans],
                r0,
                r1,
                key=record.key,
                fingerprint=record.fingerprint,
            )
            assert same_record(part, record, r0, r1)
        bundle = data.draw(st.lists(st.sampled_from([None, value]), max_size=4))
        unpacked = unpack_records(pack_records(bundle))
        assert [None if v is None else bytes(v) for v in unpacked] == [
            None if v is None else bytes(v) for v in bundle
        ]

    prop()
    reliability.record(
        "valid embedding records round-trip: whole, row ranges, bundles (hypothesis)",
        tried=counts["tried"],
        failed=0,
        wrong=counts["wrong"],
        lost=counts["lost"],
    )


# -- damage ----------------------------------------------------------------------------------

RECORD_DAMAGE = (
    "truncate",
    "flip-prefix",
    "flip-header",
    "flip-payload",
    "version",
    "trailing",
    "overwrite",
)
BUNDLE_DAMAGE = ("bundle-truncate", "bundle-flip", "bundle-trailing")


def damage_record(draw: st.DrawFn, value: bytearray, kind: str) -> bytearray:
    """``value`` (a record) damaged the way ``kind`` names."""
    head = header_bytes_needed(value)
    if kind == "truncate":
        return value[: draw(st.integers(0, len(value) - 1))]
    if kind.startswith("flip"):
        lo, hi = {
            "flip-prefix": (0, PREFIX.size),
            "flip-header": (PREFIX.size, head),
            "flip-payload": (head, len(value)),
        }[kind]
        if hi <= lo:  # a record with no payload bytes: flip the header instead
            lo, hi = PREFIX.size, head
        value[draw(st.integers(lo, hi - 1))] ^= draw(st.integers(1, 255))
    elif kind == "version":
        version = draw(st.integers(0, 2**16 - 1).filter(lambda v: v != FORMAT_VERSION))
        struct.pack_into("<H", value, 4, version)
    elif kind == "trailing":
        value += draw(st.binary(min_size=1, max_size=70))
    else:  # a run of bytes overwritten anywhere
        at = draw(st.integers(0, len(value) - 1))
        patch = draw(st.binary(min_size=1, max_size=32))[: len(value) - at]
        if value[at : at + len(patch)] == patch:
            patch = bytes([patch[0] ^ 0xFF]) + patch[1:]
        value[at : at + len(patch)] = patch
    return value


def damage_bundle(draw: st.DrawFn, body: bytearray, kind: str) -> bytearray:
    if kind == "bundle-truncate":
        return body[: draw(st.integers(0, len(body) - 1))]
    if kind == "bundle-flip":
        body[draw(st.integers(0, len(body) - 1))] ^= draw(st.integers(1, 255))
        return body
    return body + draw(st.binary(min_size=1, max_size=16))


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """("ok", result) | ("refused", RecordFormatError) | ("escaped", any other exception)."""
    try:
        return "ok", fn(*args, **kwargs)
    except RecordFormatError as exc:
        return "refused", exc
    except Exception as exc:  # the property under test: nothing else may escape
        return "escaped", exc


def _read_bundle(raw: bytes) -> list[EmbeddingRecord | None]:
    return [None if v is None else decode_record(v) for v in unpack_records(raw)]


def _check_record(
    record: EmbeddingRecord, value: bytes, kind: str, data: st.DataObject, counts: Counter
) -> None:
    """decode_record and a row read of a damaged value: refused, or the very same data."""
    # the strictest reader: no key or fingerprint to compare against, the header alone must hold
    status, got = _outcome(decode_record, value)
    counts[status] += 1
    assert status != "escaped", f"{kind}: {got!r}"
    if status == "ok":
        counts["wrong"] += not same_record(got, record)
        assert same_record(got, record), f"{kind}: a damaged value decoded to other data"
    elif kind == "version" and struct.unpack_from("<H", value, 4)[0] > FORMAT_VERSION:
        assert got.newer_version  # kept for newer readers, still a miss here

    # a row read: the header from the value's head, then the spans that header names
    status, header = _outcome(read_header, value)
    assert status != "escaped", f"{kind}: read_header: {header!r}"
    if status == "ok" and header.num_tokens > 0:
        r0 = data.draw(st.integers(0, header.num_tokens - 1))
        r1 = data.draw(st.integers(r0 + 1, header.num_tokens))
        spans = row_spans(header, r0, r1)
        status, part = _outcome(
            decode_rows, header, [value[s.start : s.end] for s in spans], r0, r1
        )
        assert status != "escaped", f"{kind}: decode_rows: {part!r}"
        if status == "ok":
            counts["wrong"] += not same_record(part, record, r0, r1)
            assert same_record(part, record, r0, r1), f"{kind}: damaged rows decoded"


def _check_bundle(
    record: EmbeddingRecord, items: list, body: bytes, kind: str, counts: Counter
) -> None:
    status, got = _outcome(_read_bundle, body)
    counts[status] += 1
    assert status != "escaped", f"{kind}: {got!r}"
    if status == "ok":
        ok = len(got) == len(items) and all(
            (g is None) == (w is None) and (g is None or same_record(g, record))
            for g, w in zip(got, items, strict=True)
        )
        counts["wrong"] += not ok
        assert ok, f"{kind}: a damaged bundle decoded to other data"


def test_damaged_values_are_refused_never_misread(reliability: Any) -> None:
    counts: Counter = Counter()

    @FUZZ
    @given(record=records(), kind=st.sampled_from(RECORD_DAMAGE + BUNDLE_DAMAGE), data=st.data())
    def prop(record: EmbeddingRecord, kind: str, data: st.DataObject) -> None:
        counts["tried"] += 1
        value = bytearray(encode_record(record))
        if kind in RECORD_DAMAGE:
            damaged = bytes(damage_record(data.draw, value, kind))
            _check_record(record, damaged, kind, data, counts)
        else:
            items = data.draw(
                st.lists(st.sampled_from([None, bytes(value)]), min_size=1, max_size=4)
            )
            body = damage_bundle(data.draw, bytearray(pack_records(items)), kind)
            _check_bundle(record, items, bytes(body), kind, counts)

    prop()
    reliability.record(
        "damaged embedding records and bundles: truncated, flipped, other version, trailing "
        "bytes (hypothesis)",
        tried=counts["tried"],
        failed=counts["escaped"],
        wrong=counts["wrong"],
        lost=0,
        note=f"{counts['refused']:,} refused as misses",
    )


# -- headers a buggy writer could write ------------------------------------------------------

_any_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _rewrite(value: bytes, doc: Any) -> bytes:
    """``value`` with its header replaced by msgpack of ``doc``, prefix and header checksum
    made consistent (what a writer with a bug would store)."""
    old = read_header(value)
    header = msgpack.packb(doc)
    offset = _align(PREFIX.size + len(header) + SUM_BYTES)
    out = bytearray(offset) + value[old.payload_offset :]
    _write_head(out, header, offset)
    return bytes(out)


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(record=records(), data=st.data())
def test_a_buggy_writers_headers_never_crash_the_reader(
    record: EmbeddingRecord, data: st.DataObject
) -> None:
    """A header that passes its checksum but holds fields of the wrong type, sign or size
    (one field replaced by an arbitrary msgpack value): RecordFormatError or a consistent
    record, never another exception (nor a huge allocation from a length taken on trust)."""
    value = bytes(encode_record(record))
    doc = msgpack.unpackb(value[PREFIX.size : header_bytes_needed(value) - SUM_BYTES], raw=False)
    target = doc
    if data.draw(st.booleans()):
        target = doc["tensors"][data.draw(st.integers(0, len(doc["tensors"]) - 1))]
    name = data.draw(st.sampled_from(sorted(target)))
    replacement = data.draw(_any_value)
    if name == "shape" and data.draw(st.booleans()):
        replacement = [data.draw(st.integers(-(2**40), 2**40)) for _ in range(2)]
    target[name] = replacement
    status, got = _outcome(decode_record, _rewrite(value, doc))
    assert status != "escaped", f"{name}={replacement!r}: {got!r}"
    if status == "ok":
        assert all(t.shape[0] == got.num_tokens for t in got.tensors.values())
