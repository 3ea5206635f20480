"""What the client hands back: an :class:`ImageHandle` per encoded image, a
:class:`FetchedChunk` per prefill chunk."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from vitserve.cache.codec import DTYPES, FrameGroup, frame_groups
from vitserve.client.chunks import ChunkPiece
from vitserve.media import VideoFor


@dataclass(frozen=True, slots=True)
class ImageHandle:
    """One image's embedding in the store: what a prefill needs to place and fetch it.

    ``shape`` is ``(num_tokens, hidden)`` of the embedding the LLM consumes; ``extras`` names the
    further per-row tensors (Qwen3-VL: ``deepstack_0``...); ``grid`` is Qwen's ``(t, h, w)``
    patch grid (else None); ``cached`` says the service held it before this call;
    ``uploaded`` that this call sent its bytes (the store lacked it when probed); ``published``
    False that the service answered after its publish failed (the store was unavailable): the
    record is not in the store yet. The image's bytes ride along (not compared, not shown) so an
    entry evicted before its fetch can be encoded again without the caller.
    """

    key: str
    num_tokens: int
    grid: tuple[int, int, int] | None
    dtype: str
    shape: tuple[int, int]
    cached: bool
    extras: tuple[str, ...] = ()
    source: bytes | None = field(default=None, repr=False, compare=False)
    uploaded: bool = field(default=False, compare=False)
    published: bool = field(default=True, compare=False)
    # a video's sampled frames' times in seconds (its record's; ``frame_groups`` maps them to
    # rows); None for an image
    times: tuple[float, ...] | None = None
    frame_rate: float | None = None  # a video's sampled frames per second of video
    # whose sampling a video was keyed under (encoded again so after an eviction)
    video_for: VideoFor = field(default=VideoFor.MODEL, compare=False)

    @classmethod
    def from_item(
        cls, item: dict[str, Any], source: bytes | None = None, uploaded: bool = False
    ) -> ImageHandle:
        """From an item of the API's encode or probe answer."""
        grid = item.get("grid")
        return cls(
            key=item["key"],
            num_tokens=int(item["num_tokens"]),
            grid=tuple(grid) if grid else None,
            dtype=item["dtype"],
            shape=(int(item["shape"][0]), int(item["shape"][1])),
            cached=bool(item.get("cached", False)),
            extras=tuple(item.get("extras") or ()),
            source=source,
            uploaded=uploaded,
            published=bool(item.get("published", True)),
            times=tuple(float(t) for t in item["times"]) if item.get("times") else None,
            frame_rate=float(item["frame_rate"]) if item.get("frame_rate") else None,
        )

    def frame_groups(self) -> list[FrameGroup]:
        """A video's frame groups: each one's rows and its frames' times (``[]``: an image)."""
        return frame_groups(self.num_tokens, self.grid, self.times)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the embedding (extras come on top)."""
        return self.shape[1] * DTYPES[self.dtype].itemsize


@dataclass(frozen=True, slots=True)
class FetchedChunk:
    """The image rows one prefill chunk ``[start, end)`` needs, piece by piece.

    ``embeddings[i]`` (and ``extras[i]``) hold the rows of ``pieces[i]``, to be placed at chunk
    positions ``[pieces[i].dest, pieces[i].dest + pieces[i].rows)``. Without a device they are
    read-only numpy arrays that view the fetched bytes (bf16 as raw ``uint16`` words); with one,
    torch tensors on it (bf16 as ``torch.bfloat16``), moved non-blocking.
    """

    start: int
    end: int
    pieces: list[ChunkPiece]
    embeddings: list[Any]
    extras: list[dict[str, Any]]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


class EncodeWait(enum.Enum):
    """When the service answers an encode (``POST /v1/encode?wait=...``; the handle transport's
    ``"wait"``): ``published`` (the default) once every new image's embedding is in the store;
    ``claimed`` once every new image is claimed for encoding (the service then encodes and
    publishes it after answering: a reader of the store sees the claim, then the record)."""

    PUBLISHED = "published"
    CLAIMED = "claimed"


@dataclass(frozen=True, slots=True)
class Submitted:
    """One image of :meth:`~vitserve.client.EncoderClient.submit`: its ``key``; ``handle`` when
    the store holds its embedding already, None while the service encodes it (its claim held:
    a reader waits for the record, and reads a miss if the claim ends without one);
    ``uploaded`` that this call sent its bytes."""

    key: str
    handle: ImageHandle | None
    uploaded: bool = False

    @property
    def pending(self) -> bool:
        return self.handle is None


__all__ = ["EncodeWait", "FetchedChunk", "ImageHandle", "Submitted"]
