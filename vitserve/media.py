"""What kind of media an item's bytes are: an image or a video, told from the first bytes.

Every process that keys an item (the SDK, the ingress, the vLLM front) and every process that
prepares one (the encoder's preprocessing) asks this one function, so a video is keyed and
prepared as a video everywhere, whatever field or part it came in.

Invariants:

* :func:`media_of` reads at most the first 12 bytes and never fails: the containers vitserve
  decodes as video (ISO BMFF ``ftyp``: MP4/MOV; EBML: Matroska/WebM; RIFF ``AVI ``) are
  ``Media.VIDEO``, anything else ``Media.IMAGE`` (whose decoder names what is wrong with it).
* No image format vitserve decodes starts like one of those containers (a WebP is RIFF
  ``WEBP``; JPEG, PNG, GIF, BMP, TIFF have their own magic), so no image is taken for a video.
"""

from __future__ import annotations

import enum

__all__ = ["Media", "VideoFor", "media_of"]


class Media(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


class VideoFor(enum.Enum):
    """Whose frame sampling a video is encoded under (an encode's ``video_for``; part of the
    video's key): the model's video processor's (its checkpoint's settings), or vLLM's
    loader's for the model's family (``FamilySpec.vllm_video`` over the model's), so that
    what vitserve encodes for vLLM is what vLLM would sample from the same bytes."""

    MODEL = "model"
    VLLM = "vllm"


_EBML = b"\x1a\x45\xdf\xa3"


def media_of(data: bytes | bytearray | memoryview) -> Media:
    """``Media.VIDEO`` for the start of an MP4/MOV, Matroska/WebM or AVI container."""
    head = bytes(memoryview(data)[:12])
    if head[4:8] == b"ftyp" or head[:4] == _EBML or (head[:4] == b"RIFF" and head[8:12] == b"AVI "):
        return Media.VIDEO
    return Media.IMAGE
