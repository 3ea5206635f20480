"""Safe decoding of untrusted video bytes into the frames a model samples (PyAV).

A video's decode costs what its header says it holds (frames times pixels), not its bytes: a
few hundred KB of H.264 can hold an hour of 4K. So everything that bounds the decode is read
from the container's header first (:func:`probe`), checked against :class:`VideoLimits`, and
only then are frames decoded (:func:`decode_frames`), as many as the sampling needs.

Invariants:

* Limits before decode work: the byte size before the container is opened; the container
  format and the codec against :data:`ALLOWED_FORMATS` / :data:`ALLOWED_CODECS`; the frame size,
  frame count, frame rate and duration from the header, before any frame is decoded. A stream
  whose header gives neither a frame count nor a duration with a rate is refused: its decode
  could not be bounded.
* Sampling (:func:`sample_indices`) is the model's video processor's ``sample_frames`` with
  ``fps``, by its :class:`FrameRule`: Qwen2-VL's (the clip's frames at ``fps`` a second, at
  least ``min_frames`` and at most ``max_frames`` and the clip's own count, a multiple of the
  temporal patch, spread evenly, indices truncated from float32 steps as transformers computes
  them) or Qwen3-VL's (as many, not rounded to the temporal patch, at ``round(linspace)``),
  or with ``num_frames`` set, that many spread evenly (Gemma 4's: transformers' steps, or
  vLLM's loader's ``linspace`` by :attr:`FrameRule.LINSPACE`).
* Decoding keeps only the sampled frames, one at a time to the caller, and stops after the
  last; it never decodes past the header's frame count. A stream that ends before its last
  sampled frame is refused as truncated, never padded.
* Every exception that escapes is an :class:`~vitserve.errors.ImageError` subclass carrying
  the caller's ``index`` (:class:`~vitserve.errors.VideoDecodeError`,
  :class:`~vitserve.errors.ImageTooLargeError`); never a bare PyAV error.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from vitserve.errors import ImageTooLargeError, VideoDecodeError

__all__ = [
    "ALLOWED_CODECS",
    "ALLOWED_FORMATS",
    "DEFAULT_VIDEO_LIMITS",
    "FrameRule",
    "VideoInfo",
    "VideoLimits",
    "VideoSampling",
    "decode_frames",
    "probe",
    "sample_indices",
]

#: container formats opened (FFmpeg's demuxer names; a demuxer may list several)
ALLOWED_FORMATS = ("mov", "mp4", "matroska", "webm", "avi")
#: video codecs decoded
ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")


@dataclass(frozen=True, kw_only=True)
class VideoLimits:
    """Per-video limits, checked before any frame is decoded."""

    max_video_bytes: int = 256 * 2**20
    max_video_seconds: float = 600.0
    max_video_frames: int = 36_000  # frames the header counts: what a decode may walk
    max_frame_pixels: int = 3840 * 2160  # width * height of one frame


DEFAULT_VIDEO_LIMITS = VideoLimits()


class FrameRule(enum.Enum):
    """Whose ``sample_frames`` (and, for Qwen3-VL, whose frame sizing) a model's video
    processor runs."""

    QWEN2 = "qwen2"  # Qwen2VLVideoProcessor: per-frame pixel bounds
    QWEN3 = "qwen3"  # Qwen3VLVideoProcessor: pixel bounds over the whole clip
    # vLLM's generic (OpenCV) loader, with ``num_frames`` set: that many frames at
    # ``np.linspace(0, total - 1, n, dtype=int)``, every frame of a clip that has no more
    LINSPACE = "linspace"


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """How a model's video processor picks and sizes frames: ``fps`` a second, within
    ``[min_frames, max_frames]``, a multiple of ``temporal_patch`` (the Qwen families), or
    ``num_frames`` spread evenly (Gemma 4's, when set); every field changes the rows."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch: int = 2
    # each frame's pixels after the resize, as the video processor bounds them (Qwen2-VL's
    # defaults: 128 to 768 merged patches of 28 px)
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    # Gemma 4: frames spread evenly over the clip (0: sample by fps), each within this many
    # soft tokens (its video processor's 32 frames of 70 tokens)
    num_frames: int = 0
    max_soft_tokens: int = 0
    rule: FrameRule = FrameRule.QWEN2

    def __post_init__(self) -> None:
        object.__setattr__(self, "rule", FrameRule(self.rule))  # its value reads back as it

    def settings(self) -> dict[str, float | int | str]:
        """Every field, by name (the rule by its value): part of a video's key."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out["rule"] = self.rule.value
        return out

    def replaced(self, settings: Mapping[str, Any]) -> VideoSampling:
        """This sampling with ``settings`` (by field name, the rule by its value) in place of
        its own: a consumer that samples otherwise (``FamilySpec.vllm_video``)."""
        unknown = set(settings) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"not video sampling fields: {sorted(unknown)}")
        kinds = {f: type(getattr(self, f)) for f in self.__dataclass_fields__}
        fields = {k: v if k == "rule" else kinds[k](v) for k, v in settings.items()}
        return dataclasses.replace(self, **fields)

    @classmethod
    def from_config(
        cls, defaults: Mapping[str, Any], config: Mapping[str, Any] | None = None
    ) -> VideoSampling:
        """A family's sampling: its video processor's ``defaults`` (the family spec's
        ``video``), overridden by what a checkpoint's ``video_preprocessor_config.json``
        (``config``) sets, read under transformers' names (``size.shortest_edge`` /
        ``longest_edge`` or ``min_pixels`` / ``max_pixels``, ``temporal_patch_size``)."""
        doc = dict(config or {})
        given_size = doc.get("size")
        size: Mapping[str, Any] = given_size if isinstance(given_size, Mapping) else {}
        given = {
            "fps": doc.get("fps"),
            "min_frames": doc.get("min_frames"),
            "max_frames": doc.get("max_frames"),
            "temporal_patch": doc.get("temporal_patch_size"),
            "min_pixels": size.get("shortest_edge", doc.get("min_pixels")),
            "max_pixels": size.get("longest_edge", doc.get("max_pixels")),
            "num_frames": doc.get("num_frames"),
            "max_soft_tokens": doc.get("max_soft_tokens"),
        }
        fields = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        kinds = {f: type(getattr(cls(), f)) for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: kinds[k](v) for k, v in fields.items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"unreadable video sampling {fields}: {exc}") from None


@dataclass(frozen=True, slots=True)
class VideoInfo:
    """What a video's header says: the size of its frames, how many there are, their rate."""

    format: str
    codec: str
    width: int
    height: int
    frames: int
    fps: float
    seconds: float


def _refuse(index: int, reason: str) -> VideoDecodeError:
    return VideoDecodeError(index, reason)


def _open(data: bytes | bytearray | memoryview, index: int) -> Any:
    import av  # heavy (FFmpeg): loaded by the first video, not by importing the encoder

    try:
        return av.open(io.BytesIO(bytes(data)), mode="r")
    except av.FFmpegError as exc:
        raise _refuse(index, f"not a video vitserve can open: {exc}") from None


def _header(container: Any, index: int) -> VideoInfo:
    names = str(container.format.name).split(",")
    if not set(names) & set(ALLOWED_FORMATS):
        raise _refuse(index, f"container {container.format.name!r} is not one of {ALLOWED_FORMATS}")
    if not container.streams.video:
        raise _refuse(index, "the container holds no video stream")
    stream = container.streams.video[0]
    codec = str(stream.codec_context.name)
    if codec not in ALLOWED_CODECS:
        raise _refuse(index, f"codec {codec!r} is not one of {ALLOWED_CODECS}")
    rate = stream.average_rate or stream.guessed_rate
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / 1_000_000
    else:
        seconds = 0.0
    frames = int(stream.frames) or (round(seconds * float(rate)) if rate and seconds else 0)
    if not frames or not rate or rate <= 0:
        raise _refuse(index, "the header gives no frame count or rate: its decode is unbounded")
    return VideoInfo(
        format=names[0],
        codec=codec,
        width=int(stream.width),
        height=int(stream.height),
        frames=frames,
        fps=float(Fraction(rate)),
        seconds=seconds or frames / float(rate),
    )


def _check(info: VideoInfo, limits: VideoLimits, index: int) -> None:
    checks = (
        ("max_frame_pixels", info.width * info.height, limits.max_frame_pixels),
        ("max_video_frames", info.frames, limits.max_video_frames),
        ("max_video_seconds", math.ceil(info.seconds), limits.max_video_seconds),
    )
    for name, value, allowed in checks:
        if value > allowed:
            raise ImageTooLargeError(index, name, int(value), int(allowed))
    if info.width <= 0 or info.height <= 0:
        raise _refuse(index, f"frames of {info.width}x{info.height} pixels")


def probe(
    data: bytes | bytearray | memoryview,
    *,
    index: int = 0,
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
) -> VideoInfo:
    """The video's header, checked against ``limits``; no frame is decoded."""
    if len(data) > limits.max_video_bytes:
        raise ImageTooLargeError(index, "max_video_bytes", len(data), limits.max_video_bytes)
    container = _open(data, index)
    try:
        info = _header(container, index)
    finally:
        container.close()
    _check(info, limits, index)
    return info


def sample_indices(info: VideoInfo, sampling: VideoSampling, *, index: int = 0) -> list[int]:
    """The frames the model's video processor samples (see the module's invariants); with
    ``num_frames`` set, transformers' default sampling (``i * total // num_frames``), or vLLM's
    loader's (:attr:`FrameRule.LINSPACE`), over all the clip's frames where it has fewer."""
    total, tps = info.frames, sampling.temporal_patch
    if sampling.num_frames:
        count = min(sampling.num_frames, total)
        if sampling.rule is FrameRule.LINSPACE:
            if count == total:
                return list(range(total))
            return [int(i) for i in np.linspace(0, total - 1, count, dtype=int)]
        return [i * total // count for i in range(count)]
    if sampling.rule is FrameRule.QWEN3:
        count = int(total / info.fps * sampling.fps)
        count = min(max(count, sampling.min_frames), sampling.max_frames, total)
        return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int)]
    most = math.floor(min(sampling.max_frames, total) / tps) * tps
    wanted = total / info.fps * sampling.fps
    count = math.floor(min(max(wanted, sampling.min_frames), most, total) / tps) * tps
    if count <= 0:
        raise _refuse(index, f"{total} frames: fewer than one temporal patch of {tps}")
    step = total / count
    # torch.arange(0, total, step).int(): float32 values, computed in double, truncated
    steps = math.ceil(total / step)
    return [int(np.float32(i * step)) for i in range(steps)]


def decode_frames(
    data: bytes | bytearray | memoryview,
    indices: Sequence[int],
    *,
    index: int = 0,
    limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
) -> Iterator[np.ndarray]:
    """The frames at ``indices`` (increasing), in order, each an ``[H, W, 3]`` uint8 RGB array;
    limits checked first (:func:`probe`). Decoding stops after the last one."""
    import av  # heavy (FFmpeg): loaded by the first video, not by importing the encoder

    if list(indices) != sorted(set(indices)) or not indices or indices[0] < 0:
        raise ValueError(f"indices must be increasing and non-negative, got {list(indices)[:8]}")
    if len(data) > limits.max_video_bytes:
        raise ImageTooLargeError(index, "max_video_bytes", len(data), limits.max_video_bytes)
    container = _open(data, index)
    try:
        info = _header(container, index)
        _check(info, limits, index)
        if indices[-1] >= info.frames:
            raise ValueError(f"frame {indices[-1]} of a video of {info.frames}")
        wanted = iter(indices)
        target = next(wanted)
        position = -1
        try:
            for position, frame in enumerate(container.decode(video=0)):
                if position == target:
                    yield frame.to_ndarray(format="rgb24")
                    target = next(wanted, -1)
                    if target < 0:
                        return
                if position + 1 >= info.frames:
                    break
        except av.FFmpegError as exc:
            raise _refuse(index, f"corrupt video at frame {position + 1}: {exc}") from None
        raise _refuse(
            index,
            f"the stream ended after {position + 1} frames; frame {target} was sampled "
            f"(the header counts {info.frames})",
        )
    finally:
        container.close()
