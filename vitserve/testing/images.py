"""Synthetic images for tests, the demo and benchmarks (no files, no network).

Images are smooth gradients plus seeded noise, so that different seeds give visibly different
embeddings and compression stays realistic (pure noise would make PNGs huge and JPEGs odd).
The work bombs below feed the decode-work benchmark and tests. The crafted inputs only the
tests use (a mixed set, bad images, decompression bombs) are ``tests/image_inputs.py``.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def make_image(
    width: int,
    height: int,
    *,
    mode: str = "RGB",
    fmt: str = "PNG",
    seed: int = 0,
    quality: int = 90,
) -> bytes:
    """Encoded bytes of a ``width`` x ``height`` image in PIL ``mode``, saved as ``fmt``."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    freq = rng.uniform(2, 8, size=3)
    channels = [
        127 + 90 * np.sin(freq[c] * (x / width + y / height) * np.pi + phase[c]) for c in range(3)
    ]
    rgb = np.stack(channels, axis=-1) + rng.normal(0, 12, size=(height, width, 3))
    image = Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        alpha = np.linspace(0, 255, width, dtype=np.float32)[None, :] * np.ones((height, 1))
        image.putalpha(Image.fromarray(alpha.astype(np.uint8), "L"))
    elif mode == "P":
        image = image.quantize(colors=64)
    elif mode != "RGB":
        image = image.convert(mode)
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt in ("JPEG", "WEBP") else {}
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


# -- work bombs: small files whose structure, not their pixels, makes decoding costly -----------
def _jpeg_segments(data: bytes) -> list[tuple[int, int]]:
    """``(start, end)`` of each marker segment of a well-formed JPEG (a scan with its entropy
    data), in order, SOI and EOI excluded."""
    out, pos = [], 2
    while pos < len(data) and data[pos + 1] != 0xD9:
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        end = pos + 2 + length
        if data[pos + 1] == 0xDA:  # to the next marker that is not a restart or stuffing
            while not (data[end] == 0xFF and data[end + 1] not in (0, *range(0xD0, 0xD8))):
                end += 1
        out.append((pos, end))
        pos = end
    return out


def jpeg_scan_bomb(side: int = 2048, extra_scans: int = 2000, seed: int = 0) -> bytes:
    """A flat grey ``side`` x ``side`` progressive JPEG whose last scan is repeated
    ``extra_scans`` times (libjpeg-turbo's "scan bomb"): tens of KB that cost libjpeg one pass
    over the image per scan. ``seed`` goes into a comment segment: distinct files (and keys),
    the same work."""
    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, "JPEG", progressive=True, quality=90)
    data = buf.getvalue()
    start, end = _jpeg_segments(data)[-1]
    comment = f"vitserve scan bomb {seed}".encode()
    com = b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment
    return data[:2] + com + data[2:end] + data[start:end] * extra_scans + data[end:]


def jpeg_with_stray_bytes(count: int, seed: int = 0) -> bytes:
    """A small JPEG with ``count`` stray bytes after its first segment (decoders skip them; PIL
    reads them one at a time)."""
    data = make_image(64, 48, fmt="JPEG", seed=seed)
    _, end = _jpeg_segments(data)[0]
    return data[:end] + b"\x00" * count + data[end:]


def png_in_tiny_chunks(chunk: int = 1, seed: int = 0) -> bytes:
    """A small PNG whose pixel data is split into IDAT chunks of ``chunk`` bytes each."""
    with Image.open(io.BytesIO(make_image(96, 64, seed=seed))) as im:
        buf = io.BytesIO()
        im.save(buf, "PNG")
    data = buf.getvalue()
    ihdr = data[8 : 8 + 25]
    pos, idat = 8 + 25, b""
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        if data[pos + 4 : pos + 8] == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    parts = [_png_chunk(b"IDAT", idat[i : i + chunk]) for i in range(0, len(idat), chunk)]
    return data[:8] + ihdr + b"".join(parts) + _png_chunk(b"IEND", b"")


def gif_with_sub_blocks(count: int, seed: int = 0) -> bytes:
    """A small GIF with a comment extension of ``count`` one-byte sub-blocks before its image."""
    data = make_image(64, 48, mode="P", fmt="GIF", seed=seed)
    flags = data[10]
    head = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    comment = b"\x21\xfe" + b"\x01x" * count + b"\x00"
    return data[:head] + comment + data[head:]
