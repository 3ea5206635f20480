"""The chunk planner, by hand-picked cases and by property (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitserve.client.chunks import ChunkPiece, ImageSpan, chunk_bounds, plan_chunk, spans_of
from vitserve.errors import ConfigError

# text 0-4, image 0 at 5-14, text 15-19, image 1 at 20-22, image 2 at 23-30
SPANS = [ImageSpan(5, 10), ImageSpan(20, 3), ImageSpan(23, 8)]


def test_a_chunk_inside_an_image_takes_only_its_rows() -> None:
    assert plan_chunk(SPANS, 7, 12) == [ChunkPiece(0, 2, 7, 0)]


def test_a_chunk_starting_and_ending_inside_image_spans() -> None:
    assert plan_chunk(SPANS, 12, 25) == [
        ChunkPiece(0, 7, 10, 0),  # the tail of image 0
        ChunkPiece(1, 0, 3, 8),  # all of image 1
        ChunkPiece(2, 0, 2, 11),  # the head of image 2
    ]


def test_text_only_chunks_need_nothing() -> None:
    assert plan_chunk(SPANS, 0, 5) == []
    assert plan_chunk(SPANS, 15, 20) == []
    assert plan_chunk(SPANS, 31, 40) == []
    assert plan_chunk([], 0, 10) == []


@pytest.mark.parametrize(
    "spans, start, end",
    [
        (SPANS, 5, 5),
        (SPANS, -1, 3),
        ([ImageSpan(0, 0)], 0, 1),
        ([ImageSpan(5, 10), ImageSpan(10, 2)], 0, 20),
        ([ImageSpan(9, 1), ImageSpan(2, 1)], 0, 20),
    ],
)
def test_bad_arguments_are_refused(spans, start: int, end: int) -> None:
    with pytest.raises(ConfigError):
        plan_chunk(spans, start, end)


@st.composite
def prompts(draw) -> tuple[list[ImageSpan], int]:
    """Images in prompt order with text (possibly none) between them, and the prompt length."""
    spans, pos = [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 6))):
        tokens = draw(st.integers(1, 40))
        spans.append(ImageSpan(pos, tokens))
        pos += tokens + draw(st.integers(0, 5))
    return spans, max(pos, 1)


@settings(max_examples=300, deadline=None)
@given(prompt=prompts(), chunk_size=st.integers(1, 50))
def test_chunks_partitioning_the_prompt_read_every_row_once(prompt, chunk_size: int) -> None:
    spans, length = prompt
    seen: dict[tuple[int, int], int] = {}
    for start, end in chunk_bounds(length, chunk_size):
        pieces = plan_chunk(spans, start, end)
        covered = set()
        for piece in pieces:
            span = spans[piece.image]
            assert 0 <= piece.row_start < piece.row_end <= span.num_tokens
            assert piece.dest >= 0 and piece.dest + piece.rows <= end - start
            for r in range(piece.row_start, piece.row_end):
                pos = start + piece.dest + (r - piece.row_start)
                assert pos == span.offset + r  # row r lands on its own placeholder
                assert pos not in covered
                covered.add(pos)
                seen[piece.image, r] = seen.get((piece.image, r), 0) + 1
        # exactly the placeholders inside the chunk are covered
        placeholders = {p for s in spans for p in range(s.offset, s.end) if start <= p < end}
        assert covered == placeholders
        assert [p.dest for p in pieces] == sorted(p.dest for p in pieces)
    assert seen == {(i, r): 1 for i, s in enumerate(spans) for r in range(s.num_tokens)}


@st.composite
def grouped_prompts(draw) -> tuple[list[int], list[int | list[int]], list[list[int]], int]:
    """Items in prompt order, each one run (an image) or several frame groups with text
    between them (a video laid out by group): (rows, offsets, groups' rows, length)."""
    rows, offsets, groups, pos = [], [], [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            n = draw(st.integers(1, 30))
            rows.append(n), offsets.append(pos), groups.append([])
            pos += n + draw(st.integers(0, 5))
            continue
        sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
        at = []
        for size in sizes:
            at.append(pos)
            pos += size + draw(st.integers(0, 4))  # a time stamp's tokens, or none
        rows.append(sum(sizes)), offsets.append(at), groups.append(sizes)
    return rows, offsets, groups, max(pos, 1)


@settings(max_examples=300, deadline=None)
@given(prompt=grouped_prompts(), chunk_size=st.integers(1, 40))
def test_items_in_several_runs_are_read_row_by_row_once(prompt, chunk_size: int) -> None:
    """Each item's row ``r`` lands on the position its runs give it, once over the chunks."""
    rows, offsets, groups, length = prompt
    spans = spans_of(rows, offsets, groups)
    where = {}  # (item, row) -> its placeholder's position
    for k, at in enumerate(offsets):
        runs = [(at, rows[k])] if isinstance(at, int) else list(zip(at, groups[k], strict=True))
        positions = [o + i for o, n in runs for i in range(n)]
        where |= {(k, r): p for r, p in enumerate(positions)}
    seen: dict[tuple[int, int], int] = {}
    for start, end in chunk_bounds(length, chunk_size):
        for piece in plan_chunk(spans, start, end):
            for r in range(piece.row_start, piece.row_end):
                assert start + piece.dest + r - piece.row_start == where[piece.image, r]
                seen[piece.image, r] = seen.get((piece.image, r), 0) + 1
    assert seen == dict.fromkeys(where, 1)


def test_frame_groups_must_hold_the_items_rows() -> None:
    assert spans_of([6], [[0, 5]], [[4, 2]]) == [ImageSpan(0, 4, 0, 0), ImageSpan(5, 2, 0, 4)]
    for groups in ([[4, 1]], [[6]], []):
        with pytest.raises(ConfigError):
            spans_of([6], [[0, 5]], groups)


def test_chunk_edges_move_out_of_spans_kept_whole() -> None:
    # image 0 at 5-14, image 1 at 20-22, image 2 at 23-30; chunks of 8
    assert chunk_bounds(31, 8) == [(0, 8), (8, 16), (16, 24), (24, 31)]
    assert chunk_bounds(31, 8, SPANS) == [(0, 5), (5, 15), (15, 23), (23, 31)]
    # a span longer than a chunk is one chunk of its own; a chunk is never empty
    assert chunk_bounds(12, 4, [ImageSpan(0, 10)]) == [(0, 10), (10, 12)]
    with pytest.raises(ConfigError, match="after the prompt"):
        chunk_bounds(20, 8, [ImageSpan(15, 10)])


@settings(max_examples=300, deadline=None)
@given(prompt=prompts(), chunk_size=st.integers(1, 50))
def test_chunks_keeping_spans_whole_partition_the_prompt(prompt, chunk_size: int) -> None:
    spans, length = prompt
    bounds = chunk_bounds(length, chunk_size, spans)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(s < e for s, e in bounds)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    for span in spans:  # inside one chunk
        assert any(s <= span.offset and span.end <= e for s, e in bounds)
    for s, e in bounds:  # over-long only as exactly one span
        assert e - s <= chunk_size or ImageSpan(s, e - s) in spans
    if not spans:
        assert bounds == chunk_bounds(length, chunk_size)


def test_service_row_reads_are_split_by_the_byte_cap_and_joined_back() -> None:
    """``/v1/rows`` refuses an answer over ``max_rows_bytes``: the SDK's reads through the
    service go in batches under it, a read larger than the cap alone in row pieces, joined back
    into one record (the same rows, in order)."""
    import numpy as np

    from vitserve.cache.codec import EmbeddingRecord
    from vitserve.client.core import join_rows, piece_batches, row_pieces

    reads = [("a", 0, 10), ("b", 5, 7), ("c", 0, 3)]
    pieces = row_pieces(reads, max_rows=4)
    assert pieces == [
        (0, ("a", 0, 4)),
        (0, ("a", 4, 8)),
        (0, ("a", 8, 10)),
        (1, ("b", 5, 7)),
        (2, ("c", 0, 3)),
    ]
    assert row_pieces(reads, max_rows=0) == list(enumerate(reads))  # no cap: whole reads
    batches = piece_batches(pieces, max_reads=3, max_bytes=4 * 100, row_bytes=100)
    assert all(sum(e - s for _, s, e in b) * 100 <= 400 and len(b) <= 3 for b in batches)
    assert [r for b in batches for r in b] == [r for _, r in pieces]
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    parts = [
        EmbeddingRecord(
            key="a",
            fingerprint="f",
            dtype="fp32",
            num_tokens=10,
            grid=None,
            tensors={"embedding": rows[s:e]},
            row_start=s,
        )
        for s, e in ((0, 4), (4, 8), (8, 10))
    ]
    joined = join_rows(parts)
    assert joined is not None and joined.row_start == 0
    assert np.array_equal(joined.embedding, rows)
    assert join_rows([parts[0], None]) is None
