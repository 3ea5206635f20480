"""Images only the tests use: a named mix of sizes, modes and formats, and crafted inputs every
decoder must refuse (headers declaring sizes their data lacks, decompression bombs, truncated and
non-image bytes). The synthetic images the demo and the benchmarks share, and the work bombs,
are :mod:`vitserve.testing.images`."""

from __future__ import annotations

import struct
import zlib

from vitserve.testing.images import _png_chunk, make_image


def mixed_set(seed: int = 0) -> list[tuple[str, bytes]]:
    """A named mix of sizes and modes: odd sizes, grayscale, RGBA, palette, CMYK, formats."""
    return [
        ("odd-333x517-png", make_image(333, 517, seed=seed + 1)),
        ("square-480-jpeg", make_image(480, 480, fmt="JPEG", seed=seed + 2)),
        ("odd-333x517-b", make_image(333, 517, seed=seed + 3)),
        ("gray-200x120", make_image(200, 120, mode="L", seed=seed + 4)),
        ("rgba-500x300", make_image(500, 300, mode="RGBA", seed=seed + 5)),
        ("palette-257x181", make_image(257, 181, mode="P", seed=seed + 6)),
        ("cmyk-jpeg-320x240", make_image(320, 240, mode="CMYK", fmt="JPEG", seed=seed + 7)),
        ("tiny-64x64-webp", make_image(64, 64, fmt="WEBP", seed=seed + 8)),
        ("wide-1280x720-jpeg", make_image(1280, 720, fmt="JPEG", seed=seed + 9)),
        ("square-480-b-bmp", make_image(480, 480, fmt="BMP", seed=seed + 10)),
    ]


def crafted_png(width: int, height: int, bit_depth: int, idat: bytes) -> bytes:
    """A grayscale PNG whose header declares ``width x height``, with ``idat`` as its data."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", idat)
        + _png_chunk(b"IEND", b"")
    )


def crafted_bmp(width: int, height: int) -> bytes:
    """A 24-bit BMP header declaring ``width x height`` followed by 16 bytes of pixels."""
    pixels = bytes(16)
    offset = 14 + 40
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    file_header = struct.pack("<2sIHHI", b"BM", offset + len(pixels), 0, 0, offset)
    return file_header + info + pixels


def decompression_bomb(side: int = 12_000) -> bytes:
    """A real ``side`` x ``side`` 1-bit PNG of zeros: ~17 KB on the wire, 144 M pixels decoded."""
    raw = bytes((1 + side // 8) * side)  # a filter byte + side/8 bytes per row
    return crafted_png(side, side, 1, zlib.compress(raw, 9))


def bad_images() -> dict[str, bytes]:
    """Inputs every decoder must refuse: name -> bytes."""
    jpeg = make_image(320, 240, fmt="JPEG", seed=1)
    return {
        "empty": b"",
        "truncated-jpeg": jpeg[: len(jpeg) // 2],
        "text": b"This is a text file, not an image.\n" * 20,
        "bomb": decompression_bomb(),
        "declared-20000x20000": crafted_png(20_000, 20_000, 8, zlib.compress(b"\x00" * 64)),
    }
