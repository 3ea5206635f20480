"""The CPU half of encoding: bytes -> decoded RGB (limits first) -> the family's pixel arrays.

Needs the model's config and image processor only, never its weights, so it can run in CPU
workers that scale apart from the encoder. Its output, a :class:`PreparedImage`, is plain numpy:
it crosses process boundaries (the Ray object store) without being copied.

Invariants:

* An item is a video when its bytes say so (:func:`vitserve.media.media_of`), whatever route it
  came by; a video is probed (limits first), sampled as the model's video processor samples,
  decoded frame by frame and woven into one prepared item whose ``times`` are its sampled
  frames' times. A model that takes no video refuses one as that item's error.
* Every error is an :class:`~vitserve.errors.ImageError` of the item's ``index``.
"""

from __future__ import annotations

import dataclasses

from vitserve.encoder.images import DEFAULT_LIMITS, ImageLimits, decode_image
from vitserve.encoder.loading import load_preprocessor
from vitserve.encoder.towers import FamilyAdapter, PreparedImage
from vitserve.encoder.video import (
    DEFAULT_VIDEO_LIMITS,
    VideoLimits,
    VideoSampling,
    decode_frames,
    probe,
    sample_indices,
)
from vitserve.errors import ImageError, ImagePreprocessError
from vitserve.media import Media, VideoFor, media_of


class Preprocessor:
    def __init__(
        self,
        adapter: FamilyAdapter,
        limits: ImageLimits = DEFAULT_LIMITS,
        video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ) -> None:
        self.adapter = adapter
        self.limits = limits
        self.video_limits = video_limits

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        *,
        revision: str | None = None,
        limits: ImageLimits = DEFAULT_LIMITS,
        video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
    ) -> Preprocessor:
        return cls(load_preprocessor(model, revision=revision), limits, video_limits)

    def prepare(
        self,
        data: bytes | bytearray | memoryview,
        key: str,
        index: int = 0,
        video_for: VideoFor = VideoFor.MODEL,
    ) -> PreparedImage:
        """Decode (limits checked first) and preprocess one image or video (sampled
        ``video_for``'s way); raises ImageError."""
        if media_of(data) is Media.VIDEO:
            sampling = self.adapter.video_sampling_for(video_for)
            if sampling is None and self.adapter.video_sampling is not None:
                raise ImagePreprocessError(
                    index,
                    f"video_for={video_for.value}: vitserve does not know how it samples "
                    f"{self.adapter.spec.name} videos",
                )
            return self.prepare_video(data, key, index, sampling)
        image = decode_image(data, index=index, limits=self.limits)
        try:
            return self.adapter.preprocess(image, key)
        except Exception as exc:
            raise ImagePreprocessError(index, f"{type(exc).__name__}: {exc}") from exc

    def prepare_video(
        self,
        data: bytes | bytearray | memoryview,
        key: str,
        index: int = 0,
        sampling: VideoSampling | None = None,
    ) -> PreparedImage:
        """Probe (limits first), sample (``sampling``, else the model's), decode frame by frame
        and preprocess one video; raises ImageError."""
        sampling = sampling or self.adapter.video_sampling
        if sampling is None:
            raise ImagePreprocessError(index, f"{self.adapter.spec.name} takes no video")
        info = probe(data, index=index, limits=self.video_limits)
        indices = sample_indices(info, sampling, index=index)
        frames = decode_frames(data, indices, index=index, limits=self.video_limits)
        try:  # frame by frame: decoded, preprocessed, dropped
            prepared = self.adapter.preprocess_video(frames, len(indices), key, sampling)
        except ImageError as exc:  # the decode's own (this index) or the family's refusal
            if exc.index == index:
                raise
            raise ImagePreprocessError(index, exc.reason) from None
        except Exception as exc:
            raise ImagePreprocessError(index, f"{type(exc).__name__}: {exc}") from exc
        return dataclasses.replace(
            prepared,
            times=tuple(i / info.fps for i in indices),
            frame_rate=len(indices) / info.frames * info.fps,  # transformers' sampled_fps
        )
