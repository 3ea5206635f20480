"""Tests for vitserve.encoder.images: decoding untrusted bytes into RGB images."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from tests.image_inputs import crafted_bmp, crafted_png, decompression_bomb
from vitserve.encoder import images
from vitserve.encoder.images import (
    ALLOWED_FORMATS,
    DEFAULT_LIMITS,
    ImageLimits,
    decode_image,
    image_size,
)
from vitserve.errors import (
    ConfigError,
    ImageDecodeError,
    ImageError,
    ImageTooLargeError,
    VitserveError,
)

RED = (255, 0, 0)
GREEN = (0, 255, 0)
BLUE = (0, 0, 255)

# --------------------------------------------------------------------------------------------
# helpers


def encode(im: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def noise_rgb(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def two_halves(width: int, height: int, left: tuple, right: tuple) -> Image.Image:
    """An RGB image whose left half is ``left`` and right half is ``right``."""
    im = Image.new("RGB", (width, height), right)
    im.paste(left, (0, 0, width // 2, height))
    return im


@pytest.fixture(scope="module")
def png_bomb() -> bytes:
    """A real 12000x12000 1-bit PNG of zeros: ~17 KB on the wire, 144 M pixels once decoded."""
    return decompression_bomb(12_000)


def reference_rgb(data: bytes) -> np.ndarray:
    """What transformers' convert_to_rgb makes of the image (first frame, no EXIF handling)."""
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    with Image.open(io.BytesIO(data)) as im:
        return convert_to_rgb(im, return_numpy=True)


def assert_rgb(im: Image.Image, size: tuple[int, int]) -> np.ndarray:
    assert isinstance(im, Image.Image)
    assert im.mode == "RGB"
    assert im.size == size
    arr = np.asarray(im)  # also proves the pixels are loaded
    assert arr.shape == (size[1], size[0], 3)
    assert arr.dtype == np.uint8
    return arr


def composite_on_white(color: int, alpha: int) -> int:
    """transformers' formula for one channel: round(a*c + (1-a)*255)."""
    a = alpha / 255
    return round(a * color + (1 - a) * 255)


# --------------------------------------------------------------------------------------------
# valid images


@pytest.mark.parametrize(
    ("fmt", "kwargs", "lossless"),
    [
        ("JPEG", {"quality": 95}, False),
        ("PNG", {}, True),
        ("WEBP", {"lossless": True}, True),
        ("BMP", {}, True),
    ],
)
def test_decode_formats(fmt: str, kwargs: dict, lossless: bool) -> None:
    src = noise_rgb(64, 48) if lossless else two_halves(64, 48, RED, BLUE)
    out = assert_rgb(decode_image(encode(src, fmt, **kwargs)), (64, 48))
    if lossless:
        np.testing.assert_array_equal(out, np.asarray(src))
    else:
        np.testing.assert_allclose(out[24, 8], RED, atol=12)
        np.testing.assert_allclose(out[24, 56], BLUE, atol=12)


def test_decode_gif() -> None:
    src = two_halves(30, 20, RED, GREEN).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    out = assert_rgb(decode_image(encode(src, "GIF")), (30, 20))
    np.testing.assert_array_equal(out, np.asarray(src.convert("RGB")))


@pytest.mark.parametrize(("fmt", "kwargs"), [("GIF", {}), ("WEBP", {"lossless": True})])
def test_animated_gives_first_frame(fmt: str, kwargs: dict) -> None:
    frames = [Image.new("RGB", (24, 16), c) for c in (RED, GREEN, BLUE)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, **kwargs)
    with Image.open(io.BytesIO(data)) as check:
        assert check.n_frames == 3  # the fixture really is animated
    out = assert_rgb(decode_image(data), (24, 16))
    assert (out == RED).all()


def test_odd_size() -> None:
    src = noise_rgb(333, 517, seed=3)
    out = assert_rgb(decode_image(encode(src, "PNG")), (333, 517))
    np.testing.assert_array_equal(out, np.asarray(src))
    assert_rgb(decode_image(encode(src, "JPEG")), (333, 517))
    assert image_size(encode(src, "WEBP")) == (333, 517)


def test_input_types() -> None:
    src = noise_rgb(10, 7)
    data = encode(src, "PNG")
    for buf in (data, bytearray(data), memoryview(data)):
        np.testing.assert_array_equal(np.asarray(decode_image(buf)), np.asarray(src))
        assert image_size(buf) == (10, 7)


def exif_jpeg(orientation: int) -> bytes:
    """A 40x20 JPEG stored with red left / blue right halves and the given EXIF orientation."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(two_halves(40, 20, RED, BLUE), "JPEG", quality=95, exif=exif.tobytes())


@pytest.mark.parametrize(
    ("orientation", "top", "bottom"),
    [(6, RED, BLUE), (8, BLUE, RED)],  # 6: rotate 90° clockwise; 8: 90° counter-clockwise
)
def test_exif_orientation(orientation: int, top: tuple, bottom: tuple) -> None:
    data = exif_jpeg(orientation)
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.size == (40, 20)
    out = assert_rgb(decode_image(data), (20, 40))
    np.testing.assert_allclose(out[5, 10], top, atol=12)
    np.testing.assert_allclose(out[35, 10], bottom, atol=12)
    assert image_size(data) == (20, 40)


def test_exif_orientation_normal_is_untouched() -> None:
    data = exif_jpeg(1)
    out = assert_rgb(decode_image(data), (40, 20))
    np.testing.assert_allclose(out[10, 5], RED, atol=12)
    assert image_size(data) == (40, 20)


def test_grayscale_l() -> None:
    gray = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = assert_rgb(decode_image(encode(Image.fromarray(gray), "PNG")), (16, 16))
    for channel in range(3):
        np.testing.assert_array_equal(out[..., channel], gray)


def test_la_composited_on_white() -> None:
    gray = np.full((4, 4), 200, dtype=np.uint8)
    alpha = np.array([[0, 64, 128, 255]] * 4, dtype=np.uint8)
    src = Image.merge("LA", (Image.fromarray(gray), Image.fromarray(alpha)))
    data = encode(src, "PNG")
    out = assert_rgb(decode_image(data), (4, 4))
    np.testing.assert_array_equal(out, reference_rgb(data))
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert tuple(out[0, 3]) == (200, 200, 200)
    assert out[0, 2, 0] == composite_on_white(200, 128)


def test_rgba_composited_on_white() -> None:
    pixels = np.array(
        [[[10, 100, 200, 128], [255, 0, 0, 0], [0, 0, 255, 255], [50, 60, 70, 1]]],
        dtype=np.uint8,
    )
    data = encode(Image.fromarray(pixels, "RGBA"), "PNG")
    out = assert_rgb(decode_image(data), (4, 1))
    np.testing.assert_array_equal(out, reference_rgb(data))
    expected = tuple(composite_on_white(c, 128) for c in (10, 100, 200))
    assert tuple(out[0, 0]) == expected
    assert tuple(out[0, 1]) == (255, 255, 255)  # fully transparent red disappears
    assert tuple(out[0, 2]) == BLUE


def palette_image() -> Image.Image:
    im = Image.new("P", (3, 2))
    im.putpalette([*RED, *GREEN, *BLUE] + [0] * (256 - 3) * 3)
    im.putdata([0, 1, 2, 2, 1, 0])
    return im


def test_palette_without_transparency() -> None:
    data = encode(palette_image(), "PNG")
    out = assert_rgb(decode_image(data), (3, 2))
    assert [tuple(p) for p in out.reshape(-1, 3)] == [RED, GREEN, BLUE, BLUE, GREEN, RED]


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
def test_palette_with_transparency_index(fmt: str) -> None:
    data = encode(palette_image(), fmt, transparency=1)  # green is transparent
    out = assert_rgb(decode_image(data), (3, 2))
    np.testing.assert_array_equal(out, reference_rgb(data))
    assert [tuple(p) for p in out.reshape(-1, 3)] == [
        RED,
        (255, 255, 255),
        BLUE,
        BLUE,
        (255, 255, 255),
        RED,
    ]


def test_palette_with_per_entry_alpha() -> None:
    # tRNS with one alpha per palette entry: red opaque, green half, blue transparent.
    data = encode(palette_image(), "PNG", transparency=bytes([255, 128, 0]))
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.mode == "P"
        assert isinstance(raw.info["transparency"], bytes)
    out = assert_rgb(decode_image(data), (3, 2))
    np.testing.assert_array_equal(out, reference_rgb(data))
    half_green = (composite_on_white(0, 128), 255, composite_on_white(0, 128))
    assert [tuple(p) for p in out[0]] == [RED, half_green, (255, 255, 255)]


def test_cmyk_jpeg() -> None:
    cyan, magenta, yellow, black = (0, 0, 0, 0), (0, 255, 0, 0), (0, 0, 255, 0), (0, 0, 0, 255)
    src = Image.new("CMYK", (32, 32), cyan)
    src.paste(magenta, (16, 0, 32, 16))
    src.paste(yellow, (0, 16, 16, 32))
    src.paste(black, (16, 16, 32, 32))
    data = encode(src, "JPEG", quality=95)
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.mode == "CMYK"
    out = assert_rgb(decode_image(data), (32, 32))
    np.testing.assert_array_equal(out, reference_rgb(data))
    np.testing.assert_allclose(out[4, 4], (255, 255, 255), atol=12)  # no ink
    np.testing.assert_allclose(out[4, 28], (255, 0, 255), atol=12)  # magenta
    np.testing.assert_allclose(out[28, 4], (255, 255, 0), atol=12)  # yellow
    np.testing.assert_allclose(out[28, 28], (0, 0, 0), atol=12)  # black


def _vllm_rgb(im: Image.Image) -> np.ndarray:
    """What vLLM 0.32 decodes an opened image to (its ``convert_image_mode`` with the defaults:
    transparency on white by an alpha-masked paste, everything else ``convert("RGB")``)."""
    if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.split()[3])
        return np.asarray(out)
    return np.asarray(im.convert("RGB"))


def test_16bit_grayscale_as_vllm_decodes_it() -> None:
    """Samples above 255 clip as PIL, vLLM and transformers convert them (vitserve once scaled
    them to 8 bits: other pixels than the LLM server's own)."""
    samples = np.array([[0, 257, 32768, 65535], [1000, 20, 40000, 200]], dtype=np.uint16)
    data = encode(Image.fromarray(samples), "PNG")
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.mode.startswith("I")  # PIL keeps the 16-bit samples
        expected = _vllm_rgb(raw)
    out = assert_rgb(decode_image(data), (4, 2))
    np.testing.assert_array_equal(out, expected)
    assert out[0, 2, 0] == 255 and out[1, 1, 0] == 20


def test_16bit_grayscale_transparency_key_as_vllm_decodes_it() -> None:
    samples = np.array([[0, 30000, 65535, 100]], dtype=np.uint16)
    data = encode(Image.fromarray(samples), "PNG", transparency=30000)
    with Image.open(io.BytesIO(data)) as raw:
        expected = _vllm_rgb(raw)
    out = assert_rgb(decode_image(data), (4, 1))
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize(
    "samples",
    [
        np.array([[0, 257, 65535, 70000, -5]], dtype=np.int32),
        np.array([[0.0, 257.0, 65535.0, 100.0, 1e9]], dtype=np.float32),
    ],
)
def test_32bit_modes_as_vllm_converts_them(samples: np.ndarray) -> None:
    # No allowed format decodes to "I" or "F" today; the conversion is exercised directly.
    im = Image.fromarray(samples)
    assert im.mode in ("I", "F")
    out = assert_rgb(images._to_rgb(im), (5, 1))
    np.testing.assert_array_equal(out, _vllm_rgb(im))


@pytest.mark.parametrize("mode", ["LA", "RGBA", "P"])
def test_transparency_composited_as_vllm_composites_it(mode: str) -> None:
    """vitserve's alpha composite and vLLM's masked paste give the same pixels, bit for bit."""
    rng = np.random.default_rng(5)
    rgba = Image.fromarray(rng.integers(0, 256, (31, 47, 4), dtype=np.uint8), "RGBA")
    im = rgba.convert(mode) if mode != "P" else rgba.convert("RGB").quantize(16)
    kwargs = {"transparency": 3} if mode == "P" else {}
    data = encode(im, "PNG", **kwargs)
    with Image.open(io.BytesIO(data)) as raw:
        expected = _vllm_rgb(raw)
    np.testing.assert_array_equal(np.asarray(decode_image(data)), expected)


# --------------------------------------------------------------------------------------------
# bad inputs: every error is an ImageError carrying the caller's index


def assert_image_error(excinfo: pytest.ExceptionInfo, cls: type, *, index: int = 7) -> ImageError:
    err = excinfo.value
    assert type(err) is cls
    assert isinstance(err, ImageError)
    assert isinstance(err, VitserveError)
    assert err.index == index
    assert str(err).startswith(f"image {index}: ")
    assert err.to_dict()["index"] == index
    return err


@pytest.mark.parametrize("func", [decode_image, image_size])
def test_empty_input(func) -> None:
    with pytest.raises(ImageDecodeError) as excinfo:
        func(b"", index=7)
    assert assert_image_error(excinfo, ImageDecodeError).reason == "empty input (0 bytes)"


def test_truncated_jpeg() -> None:
    data = encode(noise_rgb(64, 64), "JPEG", quality=90)
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data[: len(data) // 2], index=7)
    err = assert_image_error(excinfo, ImageDecodeError)
    assert "JPEG" in err.reason
    assert "truncated" in err.reason
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_truncated_png() -> None:
    data = encode(noise_rgb(64, 64), "PNG")
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data[: len(data) // 2], index=7)
    err = assert_image_error(excinfo, ImageDecodeError)
    assert "PNG" in err.reason
    assert "truncated" in err.reason


def test_corrupt_png_pixel_data() -> None:
    # A valid header followed by an IDAT that is not a zlib stream.
    data = crafted_png(8, 8, 8, b"this is not zlib data at all")
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data, index=7)
    assert "PNG" in assert_image_error(excinfo, ImageDecodeError).reason


@pytest.mark.parametrize("func", [decode_image, image_size])
def test_text_is_not_an_image(func) -> None:
    with pytest.raises(ImageDecodeError) as excinfo:
        func(b"Hello, world!\nThis is a plain text file.\n", index=7)
    err = assert_image_error(excinfo, ImageDecodeError)
    assert err.reason == "not a recognised image (allowed: JPEG, PNG, WEBP, GIF, BMP)"


@pytest.mark.parametrize("func", [decode_image, image_size])
def test_tiff_is_not_allowed(func) -> None:
    data = encode(noise_rgb(16, 16), "TIFF")
    with Image.open(io.BytesIO(data)) as check:
        assert check.format == "TIFF"  # a perfectly valid image, just not an allowed format
    with pytest.raises(ImageDecodeError) as excinfo:
        func(data, index=7)
    err = assert_image_error(excinfo, ImageDecodeError)
    assert err.reason == "format TIFF is not allowed (allowed: JPEG, PNG, WEBP, GIF, BMP)"


def test_corrupt_header_of_allowed_format() -> None:
    data = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data, index=7)
    assert assert_image_error(excinfo, ImageDecodeError).reason == "corrupt PNG header"


def test_not_bytes() -> None:
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image("not bytes", index=7)  # type: ignore[arg-type]
    assert "str" in assert_image_error(excinfo, ImageDecodeError).reason


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("func", [decode_image, image_size])
def test_decompression_bomb_rejected_before_decode(func, png_bomb: bytes, load_calls) -> None:
    assert len(png_bomb) < 20_000
    with pytest.raises(ImageTooLargeError) as excinfo:
        func(png_bomb, index=7)
    err = assert_image_error(excinfo, ImageTooLargeError)
    assert (err.limit, err.value, err.allowed) == ("max_image_pixels", 144_000_000, 40_000_000)
    assert load_calls == []  # no pixel was decoded (the proof; no clock needed)


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_decompression_bomb_with_warnings_as_errors(png_bomb: bytes) -> None:
    # Under -W error PIL's warning becomes an exception inside Image.open; still too large.
    with pytest.raises(ImageTooLargeError) as excinfo:
        decode_image(png_bomb, index=7)
    err = assert_image_error(excinfo, ImageTooLargeError)
    assert (err.limit, err.value, err.allowed) == ("max_image_pixels", 144_000_000, 40_000_000)


@pytest.mark.parametrize(
    "data",
    [
        crafted_png(20_000, 20_000, 8, zlib.compress(b"\x00" * 100)),
        crafted_bmp(20_000, 20_000),
    ],
    ids=["png", "bmp"],
)
@pytest.mark.parametrize("func", [decode_image, image_size])
def test_huge_declared_size(func, data: bytes, load_calls) -> None:
    assert len(data) < 200
    max_pixels_before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageTooLargeError) as excinfo:
        func(data, index=7)
    err = assert_image_error(excinfo, ImageTooLargeError)
    assert (err.limit, err.value, err.allowed) == ("max_image_pixels", 400_000_000, 40_000_000)
    assert "max_image_pixels" in err.reason
    assert load_calls == []
    assert max_pixels_before == Image.MAX_IMAGE_PIXELS  # the module never touches PIL's limit


@pytest.mark.parametrize("func", [decode_image, image_size])
def test_pixel_limit_below_pil_threshold(func, load_calls) -> None:
    data = encode(noise_rgb(20, 20), "PNG")
    limits = ImageLimits(max_image_pixels=399)
    with pytest.raises(ImageTooLargeError) as excinfo:
        func(data, index=7, limits=limits)
    err = assert_image_error(excinfo, ImageTooLargeError)
    assert (err.limit, err.value, err.allowed) == ("max_image_pixels", 400, 399)
    assert load_calls == []
    assert func(data, limits=ImageLimits(max_image_pixels=400)) is not None  # limit inclusive


@pytest.mark.parametrize("func", [decode_image, image_size])
def test_too_many_bytes_rejected_before_pil(func, monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(noise_rgb(32, 32), "PNG")
    assert len(data) > 1000

    def no_open(*args, **kwargs):
        raise AssertionError("PIL must not see the bytes")

    monkeypatch.setattr(Image, "open", no_open)
    with pytest.raises(ImageTooLargeError) as excinfo:
        func(data, index=7, limits=ImageLimits(max_image_bytes=1000))
    err = assert_image_error(excinfo, ImageTooLargeError)
    assert (err.limit, err.value, err.allowed) == ("max_image_bytes", len(data), 1000)


def test_bytes_limit_is_inclusive() -> None:
    data = encode(noise_rgb(4, 4), "PNG")
    assert image_size(data, limits=ImageLimits(max_image_bytes=len(data))) == (4, 4)


# --------------------------------------------------------------------------------------------
# image_size and ImageLimits


def test_load_spy_sees_decodes(load_calls) -> None:
    # Sanity check for the fixture the "no pixel decoded" assertions rely on.
    decode_image(encode(noise_rgb(4, 4), "PNG"))
    assert load_calls  # (load() is called again, as a no-op, by getexif and convert)
    assert set(load_calls) == {"PNG (4, 4)"}


def test_truncated_header() -> None:
    data = encode(noise_rgb(64, 64), "WEBP")[:40]
    with pytest.raises(ImageDecodeError) as excinfo:
        decode_image(data, index=7)
    assert "WEBP header" in assert_image_error(excinfo, ImageDecodeError).reason


def test_image_size_reads_header_only(load_calls) -> None:
    for fmt in ALLOWED_FORMATS:
        assert image_size(encode(noise_rgb(37, 23), fmt), index=3) == (37, 23), fmt
    assert load_calls == []


def test_image_size_matches_decode() -> None:
    for data in (exif_jpeg(6), exif_jpeg(3), encode(noise_rgb(333, 517), "BMP")):
        assert image_size(data) == decode_image(data).size


def test_default_limits() -> None:
    assert ImageLimits() == DEFAULT_LIMITS
    assert DEFAULT_LIMITS.max_image_bytes == 32 * 2**20
    assert DEFAULT_LIMITS.max_image_pixels == 40_000_000
    assert ALLOWED_FORMATS == ("JPEG", "PNG", "WEBP", "GIF", "BMP")


@pytest.mark.parametrize("field", ["max_image_bytes", "max_image_pixels"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "10", None, True])
def test_limits_reject_invalid(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ImageLimits(**{field: value})


def test_limits_are_frozen_and_keyword_only() -> None:
    limits = ImageLimits(max_image_bytes=10, max_image_pixels=20)
    with pytest.raises(AttributeError):
        limits.max_image_bytes = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ImageLimits(10, 20)  # type: ignore[misc]
