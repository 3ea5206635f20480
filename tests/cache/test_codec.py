"""The record format: zero-copy decoding, row ranges, strict validation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from vitserve.cache.codec import (
    PREFIX,
    EmbeddingRecord,
    _digest,
    block_digests,
    blocks_match,
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
from vitserve.testing.records import make_record


def test_decoded_arrays_view_the_buffer() -> None:
    record = make_record(rows=500, width=256, extras=3, seed=1)
    value = bytes(encode_record(record))
    decoded = decode_record(value, key=record.key)
    base = np.frombuffer(value, dtype=np.uint8)
    for name, array in decoded.tensors.items():
        assert np.shares_memory(array, base), name
        assert not array.flags.writeable
        assert np.array_equal(array, record.tensors[name])
    assert list(decoded.tensors) == ["embedding", "deepstack_0", "deepstack_1", "deepstack_2"]
    # every tensor starts 64-byte aligned in the value
    header = read_header(value)
    assert all((header.payload_offset + t.offset) % 64 == 0 for t in header.tensors)


def test_bf16_words_become_torch_bfloat16_without_a_copy() -> None:
    import torch

    original = torch.randn(40, 24, dtype=torch.bfloat16)
    words = original.view(torch.int16).numpy().view(np.uint16)
    record = EmbeddingRecord(
        key="a" * 64,
        fingerprint="f",
        dtype="bf16",
        num_tokens=40,
        grid=None,
        tensors={"embedding": words},
    )
    decoded = decode_record(encode_record(record)).embedding
    with warnings.catch_warnings():  # torch warns that the view is read-only; it is meant to be
        warnings.simplefilter("ignore", UserWarning)
        restored = torch.from_numpy(decoded).view(torch.bfloat16)
    assert restored.data_ptr() == decoded.ctypes.data
    assert torch.equal(restored, original)


def test_header_is_readable_from_the_prefix_alone() -> None:
    value = encode_record(make_record(rows=10, seed=2))
    need = header_bytes_needed(value[: PREFIX.size])
    header = read_header(value[:need])
    assert header.num_tokens == 10 and header.total_bytes == len(value)


def test_row_span_moves_about_k_over_n_of_the_bytes() -> None:
    record = make_record(rows=4096, width=1024, dtype="fp16", extras=1, seed=3)
    value = encode_record(record)
    header = read_header(value)
    spans = row_spans(header, 1000, 1064)
    moved = sum(s.end - s.start for s in spans)
    payload = header.payload_bytes
    assert moved < payload * (64 + 2 * header.tensors[0].block_rows) / 4096
    part = decode_rows(header, [value[s.start : s.end] for s in spans], 1000, 1064)
    assert np.array_equal(part.embedding, record.embedding[1000:1064])
    assert np.array_equal(part.tensors["deepstack_0"], record.tensors["deepstack_0"][1000:1064])


def test_row_chunks_are_checked_block_by_block() -> None:
    record = make_record(rows=2000, width=512, seed=4)
    value = bytearray(encode_record(record))
    header = read_header(value)
    spans = row_spans(header, 100, 200)
    value[spans[0].start + 7] ^= 1
    with pytest.raises(RecordFormatError, match="checksum"):
        decode_rows(header, [value[s.start : s.end] for s in spans], 100, 200)
    far = row_spans(header, 1900, 2000)  # another block: unaffected by the flip
    part = decode_rows(header, [value[s.start : s.end] for s in far], 1900, 2000)
    assert np.array_equal(part.embedding, record.embedding[1900:])


def test_identity_and_length_checks() -> None:
    record = make_record(rows=8, seed=5)
    value = encode_record(record)
    with pytest.raises(RecordFormatError, match="holds key"):
        decode_record(value, key="b" * 64)
    with pytest.raises(RecordFormatError, match="fingerprint"):
        decode_record(value, fingerprint="other")
    with pytest.raises(RecordFormatError, match="bytes"):
        decode_record(bytes(value) + b"\0")


def test_encode_validates_its_input() -> None:
    good = make_record(rows=4, seed=6)
    with pytest.raises(ValueError, match="shape"):
        encode_record(EmbeddingRecord(**{**_fields(good), "num_tokens": 5}))
    with pytest.raises(ValueError, match="not fp16"):
        encode_record(EmbeddingRecord(**{**_fields(good), "dtype": "fp16"}))
    with pytest.raises(ValueError, match="dtype tag"):
        encode_record(EmbeddingRecord(**{**_fields(good), "dtype": "int8"}))


def test_zero_token_record() -> None:
    empty = EmbeddingRecord(
        key="c" * 64,
        fingerprint="f",
        dtype="fp32",
        num_tokens=0,
        grid=None,
        tensors={"embedding": np.zeros((0, 16), np.float32)},
    )
    assert decode_record(encode_record(empty)).embedding.shape == (0, 16)


def _fields(r: EmbeddingRecord) -> dict:
    return {
        f: getattr(r, f) for f in ("key", "fingerprint", "dtype", "num_tokens", "grid", "tensors")
    }


@pytest.mark.parametrize(
    "n, step",
    [
        (8192 * 16, 8192),
        (8192 * 16 + 100, 8192),
        (1000, 96),
        (7 * 16384 * 5 + 13, 7 * 16384),
        (4096, 8192),
        (0, 4096),
    ],
)
def test_block_digests_are_each_blocks_digest(n: int, step: int) -> None:
    """The vectorised pass gives, block for block, what _digest gives (the sums stored by
    older writers still check)."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = b"".join(_digest(memoryview(data)[i : i + step]) for i in range(0, n, step))
    assert block_digests(data, step) == want
    assert blocks_match(data, step, want)
    if n:
        flipped = bytearray(data)
        flipped[n // 2] ^= 1
        assert not blocks_match(bytes(flipped), step, want)
        assert not blocks_match(data, step, want[:-1] + bytes([want[-1] ^ 1]))


def test_record_bundles_round_trip_as_views_and_refuse_garbage() -> None:
    records = [encode_record(make_record(rows=r, seed=r)) for r in (3, 5)]
    body = pack_records([records[0], None, records[1]])
    got = unpack_records(body)
    assert got[1] is None
    assert bytes(got[0]) == bytes(records[0]) and bytes(got[2]) == bytes(records[1])
    assert got[0].obj is body  # a view of the body, not a copy
    for bad in (b"", b"VSRB", body[:-1], body + b"x", b"XXXX" + body[4:]):
        with pytest.raises(RecordFormatError):
            unpack_records(bad)


def test_a_videos_frame_times_round_trip_and_name_each_groups_rows() -> None:
    base = make_record(rows=12, width=8, seed=3)
    times = (0.0, 0.5, 1.0, 1.5, 2.0)  # 5 frames in 3 groups of 2 (the last frame repeated)
    video = EmbeddingRecord(
        **{**_fields(base), "grid": (3, 2, 8), "times": times, "frame_rate": 2.0}
    )
    buf = encode_record(video)
    header = read_header(buf)
    assert header.times == times and decode_record(buf).times == times
    assert header.frame_rate == decode_record(buf).frame_rate == 2.0
    assert [(g.start, g.end, g.times) for g in header.frame_groups()] == [
        (0, 4, (0.0, 0.5)),
        (4, 8, (1.0, 1.5)),
        (8, 12, (2.0,)),
    ]
    assert read_header(encode_record(base)).times is None  # an image's record has none
    assert read_header(encode_record(base)).frame_groups() == []
    for bad in ((), (1.0, 0.5, 2.0), (0.0, 0.5), (0.0, float("nan"), 1.0, 2.0, 3.0)):
        with pytest.raises(ValueError, match="frame times"):
            encode_record(EmbeddingRecord(**{**_fields(video), "times": bad}))
    with pytest.raises(ValueError, match="frame rate"):
        encode_record(EmbeddingRecord(**{**_fields(video), "frame_rate": None}))


def _fields(record: EmbeddingRecord) -> dict:
    return {f: getattr(record, f) for f in EmbeddingRecord.__dataclass_fields__}
