"""Video decoding (``vitserve.encoder.video``): limits from the header before any frame is
decoded, the Qwen processors' frame sampling, the sampled frames and nothing more, and clear
per-item errors for what is not a video vitserve decodes."""

from __future__ import annotations

import io

import numpy as np
import pytest

from vitserve.encoder.video import (
    VideoInfo,
    VideoLimits,
    VideoSampling,
    decode_frames,
    probe,
    sample_indices,
)
from vitserve.errors import ImageTooLargeError, VideoDecodeError


def clip(frames: int, width: int = 64, height: int = 48, rate: int = 10, codec: str = "libx264"):
    """An MP4 whose frame ``i`` is a flat gray of level ``8 * i`` (lossless H.264)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"qp": "0"} if codec == "libx264" else {}
        for i in range(frames):
            level = np.full((height, width, 3), (8 * i) % 256, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(level, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def info(frames: int, fps: float) -> VideoInfo:
    return VideoInfo("mp4", "h264", 64, 48, frames, fps, frames / fps)


def test_the_header_is_read_without_decoding() -> None:
    got = probe(clip(23, 64, 48, rate=10))
    assert (got.codec, got.width, got.height, got.frames, got.fps) == ("h264", 64, 48, 23, 10.0)
    assert got.seconds == pytest.approx(2.3)


@pytest.mark.parametrize(
    ("limit", "value"),
    [("max_frame_pixels", 64 * 48 - 1), ("max_video_frames", 22), ("max_video_seconds", 2)],
)
def test_limits_refuse_from_the_header(limit: str, value: int) -> None:
    data = clip(23)
    limits = VideoLimits(**{limit: value})
    with pytest.raises(ImageTooLargeError, match=limit) as caught:
        probe(data, limits=limits, index=3)
    assert caught.value.index == 3
    with pytest.raises(ImageTooLargeError, match=limit):
        next(decode_frames(data, [0], limits=limits))


def test_bytes_over_the_limit_are_refused_before_the_container_is_opened() -> None:
    with pytest.raises(ImageTooLargeError, match="max_video_bytes"):
        probe(b"\0" * 101, limits=VideoLimits(max_video_bytes=100))


@pytest.mark.parametrize(
    "data", [b"", b"not a video at all", b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64]
)
def test_what_is_not_a_video_is_a_clear_per_item_error(data: bytes) -> None:
    with pytest.raises(VideoDecodeError) as caught:
        probe(data, index=5)
    assert caught.value.index == 5 and caught.value.http_status == 422


def test_a_truncated_stream_is_refused_not_padded() -> None:
    data = clip(40)
    cut = data[: len(data) * 2 // 3]
    with pytest.raises(VideoDecodeError):
        list(decode_frames(cut, [0, 39]))


def test_an_image_format_is_not_a_video() -> None:
    from vitserve.testing.images import make_image

    with pytest.raises(VideoDecodeError, match=r"not one of|no video stream|cannot open"):
        probe(make_image(32, 32, seed=1))


@pytest.mark.parametrize(
    ("frames", "fps", "want"),
    [
        (23, 10.0, [0, 5, 11, 17]),  # 4.6 at 2 fps -> the minimum 4
        (100, 10.0, list(range(0, 100, 5))),  # 20 frames at 2 fps of a 10 s clip
        (7, 30.0, [0, 1, 3, 5]),  # under min_frames: 4, spread
        (3, 30.0, [0, 1]),  # fewer than min_frames: all it has, to a multiple of 2
    ],
)
def test_sampling_is_the_qwen_processors(frames: int, fps: float, want: list[int]) -> None:
    assert sample_indices(info(frames, fps), VideoSampling()) == want


def test_sampling_respects_max_frames_and_the_temporal_patch() -> None:
    got = sample_indices(info(10_000, 30.0), VideoSampling(max_frames=9))
    assert len(got) == 8 and got == sorted(set(got)) and got[-1] < 10_000
    with pytest.raises(VideoDecodeError, match="fewer than one temporal patch"):
        sample_indices(info(1, 30.0), VideoSampling())


def test_sampling_a_number_of_frames_is_transformers_default() -> None:
    """Gemma 4's: ``i * total // num_frames``; a clip with fewer frames gives all of them."""
    gemma = VideoSampling(num_frames=32, max_soft_tokens=70)
    assert sample_indices(info(40, 10.0), gemma) == [i * 40 // 32 for i in range(32)]
    assert sample_indices(info(5, 10.0), gemma) == [0, 1, 2, 3, 4]


def test_decoding_yields_exactly_the_sampled_frames() -> None:
    data = clip(23)
    indices = sample_indices(probe(data), VideoSampling())
    frames = list(decode_frames(data, indices))
    assert [f.shape for f in frames] == [(48, 64, 3)] * len(indices)
    levels = [int(np.median(f)) for f in frames]
    assert levels == [8 * i for i in indices]  # lossless: each frame is its own


def test_media_is_told_from_the_containers_first_bytes() -> None:
    from vitserve.media import Media, media_of
    from vitserve.testing.images import make_image

    assert media_of(clip(4)) is Media.VIDEO  # MP4: ftyp at byte 4
    assert media_of(b"\x1a\x45\xdf\xa3" + bytes(20)) is Media.VIDEO  # Matroska / WebM
    assert media_of(b"RIFF\0\0\0\0AVI LIST") is Media.VIDEO
    assert media_of(b"RIFF\0\0\0\0WEBPVP8 ") is Media.IMAGE  # a WebP is RIFF too
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert media_of(make_image(16, 16, fmt=fmt)) is Media.IMAGE, fmt
    assert media_of(b"") is Media.IMAGE and media_of(b"ftyp") is Media.IMAGE


def test_sampling_reads_a_video_processor_config_over_the_family_defaults() -> None:
    defaults = {"min_pixels": 100, "max_pixels": 1000}
    assert VideoSampling.from_config(defaults) == VideoSampling(min_pixels=100, max_pixels=1000)
    config = {
        "fps": 1,
        "max_frames": 64,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 3136, "longest_edge": 102400},
        "do_sample_frames": True,  # and whatever else a processor config holds
    }
    got = VideoSampling.from_config(defaults, config)
    assert got == VideoSampling(fps=1.0, max_frames=64, min_pixels=3136, max_pixels=102400)
    assert isinstance(got.fps, float)
    with pytest.raises(ValueError, match="unreadable video sampling"):
        VideoSampling.from_config(defaults, {"max_frames": "many"})
