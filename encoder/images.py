"""Safe decoding of untrusted image bytes into RGB PIL images.

Invariants:

* Limits are checked before any pixel is decoded: the byte size before PIL sees the data, the
  pixel count (``width * height``) from the header, before ``load()`` allocates anything, and
  the work the file's structure asks of the decoder beyond its pixels (JPEG scans, segments,
  chunks: :mod:`vitserve.encoder.decode_work`) before any of it is done. So
  :func:`image_header` (what admission reads) refuses what :func:`decode_image` would refuse
  for its size or work.
* Only the formats in :data:`ALLOWED_FORMATS` are opened; PIL's other plugins never see the data.
* :func:`decode_image` always returns a fully loaded ``RGB`` image, EXIF orientation applied,
  transparency composited onto white, every mode converted as vLLM 0.32 converts it (and
  ``transformers.image_transforms.convert_to_rgb``): an LLM server decoding the same bytes gets
  the same pixels (``tests/vllm/test_vouch.py`` checks it against a real vLLM). Animated
  GIF/WebP give their first frame.
* Every exception that escapes is an :class:`~vitserve.errors.ImageError` subclass carrying the
  caller's ``index``; never a bare PIL error or ``OSError``.
* PIL's process-wide settings (``Image.MAX_IMAGE_PIXELS``, ``ImageFile.LOAD_TRUNCATED_IMAGES``,
  warning filters) are never modified. PIL's own decompression-bomb check still runs inside
  ``Image.open`` and is translated to :class:`~vitserve.errors.ImageTooLargeError`; it therefore
  caps ``max_image_pixels`` at ``2 * Image.MAX_IMAGE_PIXELS`` (about 179 M pixels by default).
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, fields

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from vitserve.encoder.decode_work import check_decode_work
from vitserve.errors import ConfigError, ImageDecodeError, ImageTooLargeError

__all__ = [
    "ALLOWED_FORMATS",
    "DEFAULT_LIMITS",
    "ImageLimits",
    "decode_image",
    "image_header",
    "image_size",
]

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")

_ALLOWED_TEXT = ", ".join(ALLOWED_FORMATS)

# Leading bytes of common formats, used only to word the error when PIL cannot open the data.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
)

_EXIF_TRANSPOSED = frozenset({5, 6, 7, 8})  # orientations that swap width and height
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


@dataclass(frozen=True, kw_only=True)
class ImageLimits:
    """Per-image limits, checked before any pixel is decoded."""

    max_image_bytes: int = 32 * 2**20
    max_image_pixels: int = 40_000_000  # width * height
    # The decode's work beyond its pixels, read from the file's structure
    # (vitserve.encoder.decode_work): libjpeg's encoders write up to ~10 scans, mozjpeg a few
    # more; real files hold tens to thousands of segments or chunks (a PNG of 8 KiB chunks at
    # the byte limit: 4096).
    max_jpeg_scans: int = 64
    max_structure_steps: int = 65_536

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ImageLimits.{f.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = ImageLimits()


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    index: int = 0,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> Image.Image:
    """Decode ``data`` into a fully loaded RGB image (first frame, EXIF orientation applied).

    Raises :class:`ImageDecodeError` for empty, unrecognised, disallowed or corrupt data and
    :class:`ImageTooLargeError` when a limit in ``limits`` is exceeded; both carry ``index``.
    """
    with _open_checked(data, index, limits) as im:
        fmt = im.format
        try:
            im.load()  # frame 0: Image.open leaves animated images on their first frame
        except Image.DecompressionBombError as e:
            raise _bomb_error(e, index, limits) from e
        except Exception as e:
            raise ImageDecodeError(index, f"corrupt or truncated {fmt} data: {_describe(e)}") from e
        try:
            oriented = _apply_exif_orientation(im)
            return _to_rgb(oriented)
        except Exception as e:
            reason = f"cannot convert {fmt} {im.mode} image to RGB: {_describe(e)}"
            raise ImageDecodeError(index, reason) from e


def image_size(
    data: bytes | bytearray | memoryview,
    *,
    index: int = 0,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> tuple[int, int]:
    """``(width, height)`` that :func:`decode_image` would return, read from the header only.

    Runs the same byte, format and pixel-count checks as :func:`decode_image` (raising the same
    errors) but decodes no pixels. The EXIF orientation is taken into account as far as the
    header tells it (a PNG ``eXIf`` chunk placed after the pixel data is not seen).
    """
    width, height, _ = image_header(data, index=index, limits=limits)
    return width, height


def image_header(
    data: bytes | bytearray | memoryview,
    *,
    index: int = 0,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> tuple[int, int, str]:
    """``(width, height, mode)``: :func:`image_size` and the PIL mode of the stored pixels
    (what decoding them costs depends on it), from the header only, with the same checks."""
    with _open_checked(data, index, limits) as im:
        width, height = im.size
        # Image.Image.getexif reads the parsed header metadata; PngImageFile.getexif would load
        # the pixels to look for a trailing eXIf chunk.
        if _orientation(im, Image.Image.getexif) in _EXIF_TRANSPOSED:
            return height, width, im.mode
        return width, height, im.mode


def _open_checked(
    data: bytes | bytearray | memoryview, index: int, limits: ImageLimits
) -> Image.Image:
    """Check the byte limit, open lazily (header only) and check the pixel limit."""
    try:
        view = memoryview(data)
    except TypeError:
        raise ImageDecodeError(
            index, f"expected bytes-like input, got {type(data).__name__}"
        ) from None
    nbytes = view.nbytes
    if nbytes == 0:
        raise ImageDecodeError(index, "empty input (0 bytes)")
    if nbytes > limits.max_image_bytes:
        raise ImageTooLargeError(index, "max_image_bytes", nbytes, limits.max_image_bytes)
    buffer = data if isinstance(data, bytes) else view.tobytes()
    # The structure's work, before PIL reads a header: its header parsers step through stray
    # JPEG bytes and GIF sub-blocks in Python (16 MB of them: over a second in Image.open).
    fmt = _sniff(buffer)
    if fmt in ALLOWED_FORMATS:
        check_decode_work(
            buffer,
            fmt,
            index,
            max_scans=limits.max_jpeg_scans,
            max_steps=limits.max_structure_steps,
        )

    # Image.open runs PIL's own bomb check: above MAX_IMAGE_PIXELS it warns (an error under
    # "-W error"), above twice that it raises. Both mean the image is too large.
    try:
        im = Image.open(io.BytesIO(buffer), formats=ALLOWED_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _bomb_error(e, index, limits) from e
    except UnidentifiedImageError:
        raise ImageDecodeError(index, _unidentified_reason(buffer)) from None
    except Exception as e:
        what = f"{_sniff(buffer) or 'image'} header"
        raise ImageDecodeError(index, f"corrupt or truncated {what}: {_describe(e)}") from e

    width, height = im.size
    if width * height > limits.max_image_pixels:
        im.close()
        raise ImageTooLargeError(index, "max_image_pixels", width * height, limits.max_image_pixels)
    if im.format != fmt:  # PIL knew it by another signature than ours: walk it as PIL's
        try:
            check_decode_work(
                buffer,
                im.format or "",
                index,
                max_scans=limits.max_jpeg_scans,
                max_steps=limits.max_structure_steps,
            )
        except ImageTooLargeError:
            im.close()
            raise
    return im


def _bomb_error(e: Exception, index: int, limits: ImageLimits) -> ImageTooLargeError:
    """Translate PIL's decompression-bomb error or warning into ImageTooLargeError."""
    match = _BOMB_PIXELS.search(str(e))
    pixels = int(match.group(1)) if match else 0
    limit = limits.max_image_pixels
    if pixels <= limit:
        # Our limit is above PIL's threshold; report the threshold PIL enforced instead.
        pil_limit = Image.MAX_IMAGE_PIXELS or 0
        limit = 2 * pil_limit if isinstance(e, Image.DecompressionBombError) else pil_limit
    return ImageTooLargeError(index, "max_image_pixels", pixels, limit)


def _sniff(buffer: bytes) -> str | None:
    """The format the leading bytes suggest, if any; only used to word errors."""
    fmt = next((name for sig, name in _SIGNATURES if buffer.startswith(sig)), None)
    if fmt is None and buffer[:4] == b"RIFF" and buffer[8:12] == b"WEBP":
        fmt = "WEBP"
    if fmt is None and buffer[4:8] == b"ftyp":
        fmt = "HEIF/AVIF"
    return fmt


def _unidentified_reason(buffer: bytes) -> str:
    """Word the error for data that no allowed PIL plugin accepts."""
    fmt = _sniff(buffer)
    if fmt in ALLOWED_FORMATS:
        return f"corrupt {fmt} header"
    if fmt is not None:
        return f"format {fmt} is not allowed (allowed: {_ALLOWED_TEXT})"
    return f"not a recognised image (allowed: {_ALLOWED_TEXT})"


def _describe(e: BaseException) -> str:
    message = str(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _orientation(im: Image.Image, getexif=Image.Image.getexif) -> int:
    """The EXIF (or XMP) orientation, 1 when absent or when the metadata is malformed."""
    try:
        value = getexif(im).get(ExifTags.Base.Orientation, 1)
    except Exception:
        return 1  # broken metadata does not make the pixels unusable
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _apply_exif_orientation(im: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose`` when the orientation is not 1; malformed EXIF is ignored."""
    if _orientation(im, type(im).getexif) == 1:
        return im  # avoids the copy exif_transpose makes when there is nothing to do
    try:
        return ImageOps.exif_transpose(im)
    except Exception:
        return im


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert to RGB as vLLM does (``vllm.multimodal.image.convert_image_mode`` with its
    defaults) and transformers' ``convert_to_rgb``: what the LLM server decodes from the same
    bytes is what vitserve encodes.

    Images with an alpha band (``RGBA``, ``LA``, ``PA``) or ``info["transparency"]`` are
    composited onto opaque white; everything else goes through ``convert("RGB")``: CMYK as
    PIL converts it (``(255 - c) * (255 - k) / 255``, any ICC profile ignored), high bit-depth
    grayscale (``I;16*``, ``I``, ``F``) as PIL converts it too, clipping samples above 255
    (as vLLM and transformers do: scaling them would give the LLM other pixels than its own).
    """
    if im.mode == "RGB":
        return im
    if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        rgba = im if im.mode == "RGBA" else im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")
