"""Property-based tests (hypothesis) of image decoding (vitserve.encoder.images).

For any bytes (arbitrary, a valid image of an allowed format and mode, the same mutated: bits
flipped, truncated, bytes overwritten, header dimensions patched; decompression bombs):

* ``image_size`` and ``decode_image`` return normally or raise an ImageError subclass
  (ImageDecodeError / ImageTooLargeError) carrying the caller's index and a reason; nothing
  else escapes, and each call ends within a bound (a hang is a failure);
* a decoded image is a loaded RGB image of at most ``max_image_pixels`` pixels;
* the header check and the decode agree: the decode succeeds only where the header check
  passed, with the same pixel count (the same size, up to an EXIF transpose), and both refuse
  an image over the limit as too large;
* an unmutated valid image within the limits decodes (nothing valid is lost).
"""

from __future__ import annotations

import contextlib
import io
import signal
import struct
import warnings
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.fuzz.budget import examples
from vitserve.encoder.images import ALLOWED_FORMATS, ImageLimits, decode_image, image_size
from vitserve.errors import ImageDecodeError, ImageError, ImageTooLargeError

EXAMPLE_BOUND_S = 10  # far above any one example here (milliseconds): only a hang reaches it
# 1000 per property at full budget (tests/fuzz/budget.py: make test draws a fifth)
EXAMPLES = examples(1000)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class ExampleHung(BaseException):
    """An example ran past EXAMPLE_BOUND_S. A BaseException, so that the code under test's
    ``except Exception`` cannot turn it into an ImageError."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise ExampleHung in this (main) thread after ``seconds``: PIL decodes in chunks from a
    Python loop, so a decoder spinning on crafted input is interrupted between chunks."""

    def expire(signum: int, frame: Any) -> None:
        raise ExampleHung(f"example still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- inputs ------------------------------------------------------------------------------------

MODES: dict[str, tuple[str, ...]] = {
    "JPEG": ("L", "RGB", "CMYK"),
    "PNG": ("1", "L", "LA", "P", "RGB", "RGBA", "I;16"),
    "WEBP": ("RGB", "RGBA"),
    "GIF": ("P", "L"),
    "BMP": ("1", "L", "P", "RGB", "RGBA"),
}
assert set(MODES) == set(ALLOWED_FORMATS)


def make_valid(
    fmt: str,
    mode: str,
    width: int,
    height: int,
    seed: int,
    *,
    orientation: int = 1,
    frames: int = 1,
    transparency: bool = False,
) -> bytes:
    """A valid ``fmt`` image in ``mode`` (noise), optionally with an EXIF orientation, more
    frames (GIF/WEBP) or a transparency key (P/L)."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(frames):
        rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
        if mode == "P":
            im = rgba.convert("RGB").quantize(colors=16)
        elif mode == "I;16":
            im = Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
        else:
            im = rgba.convert(mode)
        images.append(im)
    kwargs: dict[str, Any] = {}
    if orientation != 1 and fmt in ("JPEG", "PNG", "WEBP"):
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    if transparency and images[0].mode in ("P", "L") and fmt in ("PNG", "GIF"):
        kwargs["transparency"] = 0
    if frames > 1 and fmt in ("GIF", "WEBP"):
        kwargs.update(save_all=True, append_images=images[1:], duration=40)
    if fmt == "WEBP":
        kwargs["lossless"] = bool(seed % 2)
    if fmt == "JPEG":
        kwargs["progressive"] = bool(seed % 2)
    buf = io.BytesIO()
    images[0].save(buf, fmt, **kwargs)
    return buf.getvalue()


@st.composite
def valid_images(draw: st.DrawFn) -> bytes:
    fmt = draw(st.sampled_from(sorted(MODES)))
    return make_valid(
        fmt,
        draw(st.sampled_from(MODES[fmt])),
        draw(st.integers(1, 40)),
        draw(st.integers(1, 40)),
        draw(st.integers(0, 2**16)),
        orientation=draw(st.sampled_from([1, 1, 3, 6, 8])),
        frames=draw(st.sampled_from([1, 1, 2])),
        transparency=draw(st.booleans()),
    )


def _png_crc(data: bytearray, start: int, length: int) -> None:
    """Recompute the CRC of the PNG chunk whose length field is at ``start``."""
    end = start + 8 + length
    struct.pack_into(">I", data, end, zlib.crc32(bytes(data[start + 4 : end])) & 0xFFFFFFFF)


def max_side(data: bytes) -> int:
    """The largest width or height the header of ``data``'s format can declare."""
    if data.startswith((b"\x89PNG", b"BM")):
        return 2**31 - 1
    return 16384 if data[:4] == b"RIFF" else 65535


def patch_dimensions(data: bytes, width: int, height: int) -> bytes:
    """``data`` with the dimensions in its header replaced (where the format keeps them)."""
    out = bytearray(data)
    if out.startswith(b"\x89PNG") and len(out) >= 33:  # the IHDR chunk and its CRC
        struct.pack_into(">II", out, 16, width, height)
        _png_crc(out, 8, 13)  # a valid CRC, so the decoder (not the CRC check) meets the lie
    elif out.startswith(b"BM") and len(out) >= 26:
        struct.pack_into("<ii", out, 18, min(width, 2**31 - 1), min(height, 2**31 - 1))
    elif out.startswith(b"GIF") and len(out) >= 10:
        w, h = min(width, 65535), min(height, 65535)
        struct.pack_into("<HH", out, 6, w, h)  # the logical screen
        at = out.find(b"\x2c", 13)  # the first image descriptor (a guess: good enough to fuzz)
        if 0 < at <= len(out) - 9:
            struct.pack_into("<HH", out, at + 5, w, h)
    elif out.startswith(b"\xff\xd8"):
        for marker in (b"\xff\xc0", b"\xff\xc1", b"\xff\xc2"):
            at = out.find(marker)
            if 0 < at <= len(out) - 9:
                struct.pack_into(">HH", out, at + 5, min(height, 65535), min(width, 65535))
    elif out[:4] == b"RIFF" and out[8:12] == b"WEBP":
        chunk = bytes(out[12:16])
        w, h = min(width, 16384), min(height, 16384)
        if chunk == b"VP8X" and len(out) >= 30:
            out[24:27] = (w - 1).to_bytes(3, "little")
            out[27:30] = (h - 1).to_bytes(3, "little")
        elif chunk == b"VP8L" and len(out) >= 25:
            bits = int.from_bytes(out[21:25], "little")
            bits = (bits & ~0xFFFFFFF) | (w - 1) | ((h - 1) << 14)
            out[21:25] = bits.to_bytes(4, "little")
        elif chunk == b"VP8 " and len(out) >= 30:
            struct.pack_into("<HH", out, 26, w & 0x3FFF, h & 0x3FFF)
    return bytes(out)


@st.composite
def mutated(draw: st.DrawFn, source: st.SearchStrategy[bytes]) -> tuple[bytes, str]:
    """A valid image and one to three mutations of it, with their names."""
    data = bytearray(draw(source))
    done = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(["flip", "flip-header", "truncate", "overwrite", "dims", "dims-small"])
        )
        if not data:
            break
        if kind.startswith("flip"):
            hi = min(len(data), 64) if kind == "flip-header" else len(data)
            data[draw(st.integers(0, hi - 1))] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            data = data[: draw(st.integers(0, len(data) - 1))]
        elif kind == "overwrite":
            at = draw(st.integers(0, len(data) - 1))
            patch = draw(st.binary(min_size=1, max_size=16))[: len(data) - at]
            data[at : at + len(patch)] = patch
        else:
            top = 64 if kind == "dims-small" else 2**31 - 1
            w, h = draw(st.integers(1, top)), draw(st.integers(1, top))
            data = bytearray(patch_dimensions(bytes(data), w, h))
        done.append(kind)
    return bytes(data), "+".join(done)


@st.composite
def limits(draw: st.DrawFn) -> ImageLimits:
    """Small limits, so that bombs are cheap to refuse and some valid images exceed them."""
    return ImageLimits(
        max_image_bytes=draw(st.sampled_from([2**10, 2**20])),
        max_image_pixels=draw(st.sampled_from([256, 1600, 10_000])),
    )


# -- the property ----------------------------------------------------------------------------


def _call(fn: Callable[..., Any], data: bytes, index: int, lim: ImageLimits) -> tuple[str, Any]:
    """("ok", result) | ("refused", ImageError) | ("escaped", any other exception)."""
    try:
        return "ok", fn(data, index=index, limits=lim)
    except ImageError as exc:
        return "refused", exc
    except Exception as exc:  # the property under test: nothing else may escape
        return "escaped", exc


def examine(data: bytes, lim: ImageLimits, index: int, counts: Counter) -> tuple[str, Any]:
    """Run the header check and the decode on ``data``, count the outcome and assert the
    properties (module docstring); returns the decode's outcome.

    Every other example runs with warnings as errors (``python -W error``): PIL's
    DecompressionBombWarning (above ``Image.MAX_IMAGE_PIXELS``) and its warnings about corrupt
    EXIF or truncated data then raise inside PIL, and must still end as ImageErrors."""
    counts["tried"] += 1
    with bounded(EXAMPLE_BOUND_S), warnings.catch_warnings():
        warnings.simplefilter("error" if counts["tried"] % 2 else "ignore")
        size_status, size = _call(image_size, data, index, lim)
        status, got = _call(decode_image, data, index, lim)
    counts[status] += 1
    for what, s, result in (("image_size", size_status, size), ("decode_image", status, got)):
        counts["failed"] += s == "escaped"
        assert s != "escaped", f"{what} let {type(result).__name__} escape: {result!r}"
        if s == "refused":
            counts["failed"] += result.index != index or not result.reason
            assert result.index == index and result.reason, result
    agree = True
    if status == "ok":
        w, h = got.size
        agree = (
            got.mode == "RGB"
            and np.asarray(got).shape == (h, w, 3)
            and w * h <= lim.max_image_pixels
            and size_status == "ok"
            and got.size in (size, size[::-1])
        )
    elif size_status == "ok":
        agree = isinstance(got, ImageDecodeError)  # the header passed; the pixels did not
    else:
        agree = type(got) is type(size)  # both refuse, for the same reason
    counts["wrong"] += not agree
    assert agree, f"header check {size_status} {size!r}, decode {status} {got!r}"
    if size_status == "ok":
        assert size[0] * size[1] <= lim.max_image_pixels
    return status, got


def test_arbitrary_and_mutated_images(reliability: Any) -> None:
    counts: Counter = Counter()
    anything = st.binary(max_size=512)
    magic = st.sampled_from(
        [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM", b"RIFF\x00\x01\x00\x00WEBPVP8X"]
    )
    with_magic = st.builds(lambda m, rest: m + rest, magic, anything)

    @FUZZ
    @given(
        case=st.one_of(
            anything.map(lambda d: (d, "bytes")),
            with_magic.map(lambda d: (d, "magic+bytes")),
            valid_images().map(lambda d: (d, "valid")),
            mutated(valid_images()),
        ),
        lim=limits(),
        index=st.integers(0, 10_000),
    )
    def prop(case: tuple[bytes, str], lim: ImageLimits, index: int) -> None:
        data, kind = case
        counts[kind.split("+")[0]] += 1
        status, got = examine(data, lim, index, counts)
        if kind == "valid" and len(data) <= lim.max_image_bytes:
            with Image.open(io.BytesIO(data)) as im:
                within = im.size[0] * im.size[1] <= lim.max_image_pixels
            counts["lost"] += within and status != "ok"
            assert status == "ok" or not within, f"a valid image was refused: {got!r}"

    prop()
    reliability.record(
        "bad image bytes: arbitrary, and valid JPEG/PNG/WEBP/GIF/BMP with bits flipped, "
        "truncated, overwritten or dimensions patched (hypothesis)",
        tried=counts["tried"],
        failed=counts["failed"],
        wrong=counts["wrong"],
        lost=counts["lost"],
        note=f"{counts['refused']:,} refused with a 4xx reason",
    )


# -- decompression bombs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_bombs() -> list[bytes]:
    """Small files that really decode to huge images (not just a lying header)."""
    from tests.image_inputs import decompression_bomb

    bombs = [decompression_bomb(12_000)]  # 144 M pixels in 17 KB: above PIL's own threshold
    for fmt, kwargs in (("GIF", {}), ("WEBP", {"lossless": True})):  # 42 M pixels, 31 / 2 KB
        buf = io.BytesIO()
        Image.new("P" if fmt == "GIF" else "L", (6500, 6500)).save(buf, fmt, **kwargs)
        bombs.append(buf.getvalue())
    return bombs


def test_decompression_bombs_are_refused_before_decoding(
    real_bombs: list[bytes], reliability: Any
) -> None:
    counts: Counter = Counter()
    small = st.sampled_from(sorted(MODES)).flatmap(
        lambda fmt: st.tuples(
            st.just(fmt),
            st.sampled_from(MODES[fmt]),
            st.integers(1, 16),
            st.integers(1, 16),
            st.integers(0, 99),
        )
    )

    @FUZZ
    @given(
        source=st.one_of(st.integers(0, len(real_bombs) - 1), small),
        data=st.data(),
        index=st.integers(0, 64),
    )
    def prop(source: int | tuple, data: st.DataObject, index: int) -> None:
        """``source``: a real bomb (its number), or the parameters of a small valid image
        whose header then declares more pixels than the limit allows."""
        lim = ImageLimits(max_image_pixels=data.draw(st.sampled_from([4096, 40_000_000])))
        if isinstance(source, int):
            bomb = real_bombs[source]
        else:
            bomb = make_valid(*source)
            side = max_side(bomb)
            w = data.draw(st.integers(-(-(lim.max_image_pixels + 1) // side), side))
            h = data.draw(st.integers(lim.max_image_pixels // w + 1, side))
            bomb = patch_dimensions(bomb, w, h)
        status, got = examine(bomb, lim, index, counts)
        assert status == "refused"
        if isinstance(source, int) or bomb[:2] in (b"\x89P", b"BM"):  # headers that parse
            assert isinstance(got, ImageTooLargeError), got
            assert got.value > got.allowed

    prop()
    reliability.record(
        "decompression bombs: real (PNG 144 Mpx in 17 KB, GIF and WEBP 42 Mpx) and small files "
        "declaring huge dimensions (hypothesis)",
        tried=counts["tried"],
        failed=counts["failed"],
        wrong=counts["wrong"],
        lost=0,
        note=f"{counts['refused']:,} refused",
    )
