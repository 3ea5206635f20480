"""The chunk planner: which embedding rows a prefill chunk needs. Pure: no I/O, no store.

A prompt holds each image as a run of placeholder tokens, one per embedding row: image ``i``
occupies prompt positions ``[offset_i, offset_i + num_tokens_i)``. A video whose frame groups
the prompt places apart (Qwen3-VL: a time stamp before each group) is one run per group: its
group ``g`` at ``[offset_ig, offset_ig + rows_ig)``, its rows in group order. A span is one
run: of item ``item``, from its row ``row``. A prefill chunk covers positions ``[start,
end)``. :func:`plan_chunk` answers with the pieces that chunk needs, each ``(image, row_start,
row_end, dest)``: rows ``[row_start, row_end)`` of item ``image`` land at chunk-relative
positions ``[dest, dest + rows)``.

Invariants (property-tested in ``tests/client/test_chunks.py``):

* The pieces are in prompt order and their destinations do not overlap; each lies inside the
  chunk (``0 <= dest`` and ``dest + rows <= end - start``) and inside its image
  (``0 <= row_start < row_end <= num_tokens``).
* Exactly the image positions inside the chunk are covered: a position ``p`` in ``[start,
  end)`` is covered iff it is a placeholder of some span, and then by row ``row + p - offset``
  of its item.
* Chunks that partition ``[0, L)`` read every row of every item exactly once between them
  (an item's spans cover its rows in order, each once: :func:`spans_of` checks it).
* An image wholly outside the chunk yields no piece; one spanning the chunk's edges yields the
  rows inside only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vitserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Where one run of an item's placeholder tokens sits in the prompt: an image's whole
    run, or one frame group of a video the prompt places apart."""

    offset: int  # prompt position of the run's first placeholder token
    num_tokens: int  # its embedding rows (= placeholder tokens)
    item: int | None = None  # the item whose rows these are (None: the span's own index)
    row: int = 0  # the item's row at ``offset``

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    """Rows ``[row_start, row_end)`` of image ``image``, at chunk position ``dest``."""

    image: int
    row_start: int
    row_end: int
    dest: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def check_spans(spans: Sequence[ImageSpan]) -> None:
    """ConfigError unless the spans are non-empty runs at non-negative, increasing,
    non-overlapping offsets (the order of the images in the prompt)."""
    prev_end = 0
    for i, span in enumerate(spans):
        if span.num_tokens < 1 or span.offset < 0:
            raise ConfigError(f"image {i}: offset {span.offset}, {span.num_tokens} tokens")
        if span.offset < prev_end:
            raise ConfigError(
                f"image {i} at {span.offset} overlaps or precedes the previous one (ends at "
                f"{prev_end}); give the images in prompt order"
            )
        prev_end = span.end


def plan_chunk(spans: Sequence[ImageSpan], start: int, end: int) -> list[ChunkPiece]:
    """The pieces prefill chunk ``[start, end)`` needs (see the module's invariants)."""
    if not 0 <= start < end:
        raise ConfigError(f"chunk [{start}, {end}) must satisfy 0 <= start < end")
    check_spans(spans)
    # the first image that ends after ``start``; spans are sorted, so their ends are too
    first = bisect.bisect_right([s.end for s in spans], start)
    pieces = []
    for i in range(first, len(spans)):
        span = spans[i]
        if span.offset >= end:
            break
        lo, hi = max(start, span.offset), min(end, span.end)
        first = span.row + lo - span.offset
        item = i if span.item is None else span.item
        pieces.append(ChunkPiece(item, first, first + hi - lo, lo - start))
    return pieces


def chunk_bounds(
    length: int, chunk_size: int, whole: Sequence[ImageSpan] = ()
) -> list[tuple[int, int]]:
    """``[start, end)`` of each prefill chunk of a ``length``-token prompt: ``chunk_size``
    tokens each, the last one shorter.

    No chunk edge falls inside a span of ``whole`` (images a family's attention forbids
    splitting: Gemma 3's image tokens attend to each other both ways). An edge that would is
    moved back to the span's start when the chunk keeps a token, else forward to its end. So
    the chunks partition ``[0, length)``, none is empty, every ``whole`` span lies inside one
    chunk, and a chunk longer than ``chunk_size`` is exactly one such span.
    """
    if length < 1 or chunk_size < 1:
        raise ConfigError(f"need length >= 1 and chunk_size >= 1, got {length}, {chunk_size}")
    check_spans(whole)
    if whole and whole[-1].end > length:
        raise ConfigError(f"an image ends at {whole[-1].end}, after the prompt ({length})")
    ends = [s.end for s in whole]
    bounds, start = [], 0
    while start < length:
        end = min(length, start + chunk_size)
        i = bisect.bisect_right(ends, end)  # the first span ending after ``end``
        if i < len(whole) and whole[i].offset < end:  # ``end`` falls inside span i
            end = whole[i].offset if whole[i].offset > start else whole[i].end
        bounds.append((start, end))
        start = end
    return bounds


def spans_of(
    num_tokens: Sequence[int],
    offsets: Sequence[int | Sequence[int]],
    groups: Sequence[Sequence[int]] | None = None,
) -> list[ImageSpan]:
    """The spans of items with ``num_tokens[k]`` rows: ``offsets[k]`` the position of item
    ``k``'s first placeholder, or, for a video whose frame groups the prompt places apart, one
    position per group, ``groups[k]`` the groups' rows (a handle's ``frame_groups()``).
    ConfigError unless such an item's groups are as many as its offsets and hold its rows."""
    if len(num_tokens) != len(offsets):
        raise ConfigError(f"{len(num_tokens)} images but {len(offsets)} offsets")
    spans = []
    for k, (n, at) in enumerate(zip(num_tokens, offsets, strict=True)):
        if isinstance(at, int):
            spans.append(ImageSpan(at, n, k))
            continue
        rows = list(groups[k]) if groups is not None and k < len(groups) else []
        if len(rows) != len(at) or sum(rows) != n:
            raise ConfigError(
                f"item {k}: {len(at)} offsets for frame groups of {rows} rows ({n} in all)"
            )
        first = 0
        for offset, r in zip(at, rows, strict=True):
            spans.append(ImageSpan(int(offset), r, k, first))
            first += r
    return spans


def item_spans(items: Sequence[Any], offsets: Sequence[int | Sequence[int]]) -> list[ImageSpan]:
    """:func:`spans_of` items with ``num_tokens`` and ``frame_groups()`` (the client's
    ``ImageHandle`` s): a video's groups' rows from its handle."""
    groups = [[g.end - g.start for g in item.frame_groups()] for item in items]
    return spans_of([item.num_tokens for item in items], offsets, groups)


__all__ = [
    "ChunkPiece",
    "ImageSpan",
    "check_spans",
    "chunk_bounds",
    "item_spans",
    "plan_chunk",
    "spans_of",
]
