"""Tests for vitserve.encoder.decode_work: the decode's work read from a file's structure, and
the images module refusing files whose structure asks more than real encoders write.

Each bomb is refused by ``image_header`` (what admission reads) and ``decode_image`` before
any pixel is decoded, and decodes, to the same pixels as its harmless twin, once the limit is
lifted: the walk counts what the decoder does, it does not misread the file.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.fuzz.budget import examples
from vitserve.encoder.decode_work import DecodeWork, check_decode_work, decode_work
from vitserve.encoder.images import DEFAULT_LIMITS, ImageLimits, decode_image, image_header
from vitserve.errors import ImageTooLargeError
from vitserve.testing.images import (
    gif_with_sub_blocks,
    jpeg_scan_bomb,
    jpeg_with_stray_bytes,
    make_image,
    png_in_tiny_chunks,
)

UNBOUNDED = ImageLimits(max_jpeg_scans=10**9, max_structure_steps=10**9)


def _work(data: bytes, fmt: str) -> DecodeWork:
    return decode_work(data, fmt, max_scans=10**9, max_steps=10**9)


def _progressive(mode: str, side: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(make_image(side, side, mode=mode))).save(buf, "JPEG", progressive=True)
    return buf.getvalue()


# -- counting what the encoders write ---------------------------------------------------------
def test_a_baseline_jpeg_is_one_scan() -> None:
    assert _work(make_image(64, 48, fmt="JPEG"), "JPEG").scans == 1


@pytest.mark.parametrize(("mode", "scans"), [("RGB", 10), ("L", 6)])
def test_libjpeg_progressive_scripts_are_counted_scan_by_scan(mode: str, scans: int) -> None:
    """libjpeg's simple progression: 10 scans for YCbCr, 6 for one component."""
    assert _work(_progressive(mode), "JPEG").scans == scans


def test_each_repeated_scan_is_counted() -> None:
    assert _work(jpeg_scan_bomb(64, 0), "JPEG").scans == 6
    assert _work(jpeg_scan_bomb(64, 37), "JPEG").scans == 6 + 37


def test_restart_markers_and_stuffed_bytes_stay_inside_their_scan() -> None:
    buf = io.BytesIO()
    noisy = Image.fromarray(np.random.default_rng(1).integers(0, 256, (256, 256, 3), np.uint8))
    noisy.save(buf, "JPEG", restart_marker_blocks=1, quality=100)  # FF D0-D7 and FF 00 galore
    data = buf.getvalue()
    assert data.count(b"\xff\xd0") > 10 and data.count(b"\xff\x00") > 10
    assert _work(data, "JPEG").scans == 1


def test_segments_inside_exif_are_not_markers() -> None:
    """An APP1 block whose bytes look like scans (an embedded thumbnail) is skipped whole."""
    data = make_image(64, 48, fmt="JPEG")
    thumb = make_image(16, 16, fmt="JPEG")
    app1 = b"Exif\x00\x00" + thumb * 3
    segment = b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1
    assert _work(data[:2] + segment + data[2:], "JPEG").scans == 1


def test_png_chunks_and_gif_blocks_are_counted() -> None:
    assert _work(png_in_tiny_chunks(1), "PNG").steps > 1000
    assert _work(png_in_tiny_chunks(8192), "PNG").steps == 4  # IHDR, IDAT, IEND, + sRGB-free
    assert _work(gif_with_sub_blocks(500), "GIF").steps >= 500


# -- refusing the bombs, before any pixel ------------------------------------------------------
BOMBS = {
    "jpeg-scans": (lambda: jpeg_scan_bomb(2048, 2000), "max_jpeg_scans"),
    "jpeg-stray-bytes": (lambda: jpeg_with_stray_bytes(200_000), "max_structure_steps"),
    "png-tiny-chunks": (lambda: png_in_tiny_chunks(1), "max_structure_steps"),
    "gif-sub-blocks": (lambda: gif_with_sub_blocks(200_000), "max_structure_steps"),
}
TIGHT = ImageLimits(max_structure_steps=4096)  # png-tiny-chunks holds ~15k chunks


@pytest.mark.parametrize("name", sorted(BOMBS))
@pytest.mark.parametrize("read", [image_header, decode_image], ids=["header", "decode"])
def test_a_bomb_is_refused_naming_its_limit_before_any_pixel(name, read, load_calls) -> None:
    make, limit = BOMBS[name]
    limits = TIGHT if name == "png-tiny-chunks" else DEFAULT_LIMITS
    data = make()
    load_calls.clear()  # making the file decoded its source
    with pytest.raises(ImageTooLargeError) as info:
        read(data, index=3, limits=limits)
    assert info.value.limit == limit and info.value.index == 3
    assert info.value.value > info.value.allowed
    assert load_calls == []


def test_the_scan_bomb_of_the_issue_is_small_and_holds_2006_scans() -> None:
    data = jpeg_scan_bomb(2048, 2000)
    assert len(data) < 64 * 1024
    with pytest.raises(ImageTooLargeError, match="max_jpeg_scans exceeded: 65 > 64"):
        image_header(data)


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_lifted_limits_decode_the_bomb_as_its_harmless_twin(name: str) -> None:
    """The walk misreads nothing: past the limit, the same file decodes to what its twin
    (the same pixels, an ordinary structure) decodes to."""
    twins = {
        "jpeg-scans": lambda: jpeg_scan_bomb(256, 0),
        "jpeg-stray-bytes": lambda: jpeg_with_stray_bytes(0),
        "png-tiny-chunks": lambda: png_in_tiny_chunks(2**20),
        "gif-sub-blocks": lambda: gif_with_sub_blocks(0),
    }
    bomb = {
        "jpeg-scans": lambda: jpeg_scan_bomb(256, 200),
        "jpeg-stray-bytes": BOMBS["jpeg-stray-bytes"][0],
        "png-tiny-chunks": BOMBS["png-tiny-chunks"][0],
        "gif-sub-blocks": BOMBS["gif-sub-blocks"][0],
    }[name]()
    expected = np.asarray(decode_image(twins[name]()))
    assert np.array_equal(np.asarray(decode_image(bomb, limits=UNBOUNDED)), expected)


def test_the_scan_limit_is_inclusive() -> None:
    at = jpeg_scan_bomb(64, 64 - 6)
    assert image_header(at)[:2] == (64, 64)
    with pytest.raises(ImageTooLargeError, match="max_jpeg_scans"):
        image_header(jpeg_scan_bomb(64, 64 - 5))
    assert image_header(at, limits=ImageLimits(max_jpeg_scans=10**9))[:2] == (64, 64)


@pytest.mark.parametrize(
    "data",
    [
        make_image(300, 200, fmt="JPEG"),
        make_image(300, 200, mode="CMYK", fmt="JPEG"),
        make_image(300, 200),
        make_image(300, 200, mode="P", fmt="GIF"),
        make_image(300, 200, fmt="WEBP"),
        make_image(300, 200, fmt="BMP"),
    ],
    ids=["jpeg", "cmyk-jpeg", "png", "gif", "webp", "bmp"],
)
def test_ordinary_files_pass_well_inside_the_limits(data: bytes) -> None:
    with Image.open(io.BytesIO(data)) as im:
        fmt = im.format or ""
    work = check_decode_work(data, fmt, 0, max_scans=64, max_steps=65_536)
    assert work.scans <= 10 and work.steps <= 64
    decode_image(data)


def test_animations_are_walked_but_not_refused() -> None:
    frames = [Image.new("RGB", (32, 32), (i * 20, 0, 0)) for i in range(12)]
    for fmt in ("GIF", "WEBP"):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=40)
        assert decode_image(buf.getvalue()).getpixel((0, 0))[1] == 0


# -- the walk itself is bounded and never fails ------------------------------------------------
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP"])
@settings(max_examples=examples(500), deadline=None)
@given(data=st.binary(max_size=4096))
def test_any_bytes_give_counts_or_nothing(fmt: str, data: bytes) -> None:
    work = decode_work(data, fmt, max_scans=8, max_steps=64)
    assert isinstance(work, DecodeWork)
    assert work.scans >= 0 and work.steps >= 0


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP"])
def test_the_walk_stops_at_its_limit_on_a_hostile_structure(fmt: str) -> None:
    """Millions of units: the count stops just past the limit, whatever the file holds."""
    hostile = {
        "JPEG": b"\xff\xd8" + b"\xff\xfe\x00\x02" * 1_000_000,  # a million empty comments
        "PNG": b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\x00tEXt\x00\x00\x00\x00" * 1_000_000,
        "GIF": b"GIF89a" + bytes(7) + b"\x21\xfe" + b"\x01x" * 1_000_000 + b"\x00",
        "WEBP": b"RIFF\x00\x00\x00\x00WEBP" + b"JUNK\x00\x00\x00\x00" * 1_000_000,
    }[fmt]
    work = decode_work(hostile, fmt, max_scans=64, max_steps=1000)
    assert 1000 < work.steps <= 1003


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_bomb_never_reaches_pils_header_parser(name, monkeypatch) -> None:
    """PIL's header parsers step through stray JPEG bytes and GIF sub-blocks in Python, so
    the walk comes before ``Image.open``: a refused file is never opened."""
    from vitserve.encoder import images

    make, _ = BOMBS[name]
    data = make()
    opened: list[int] = []
    real_open = images.Image.open

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        opened.append(1)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(images.Image, "open", spy)
    with pytest.raises(ImageTooLargeError):
        image_header(data, limits=TIGHT if name == "png-tiny-chunks" else DEFAULT_LIMITS)
    assert opened == []
