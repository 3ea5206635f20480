"""What decoding an image will cost, read from the file's structure before any pixel is decoded.

The byte and pixel limits bound what a decode *allocates*, not what it *does*. A progressive
JPEG whose last scan is repeated N times makes libjpeg pass over every coefficient N times;
stray bytes before a JPEG's first scan, PNG chunks and GIF sub-blocks each cost a turn of one
of PIL's Python loops, its header parsers' included, so a few KB to MB of them cost seconds
(measured: ``loadtest/results/decode-work-cpu.md``). This module walks a file's structure the
way the decoders will, before PIL reads its header, and refuses it, naming the limit, when it
holds more of those units than real encoders write.

Invariants:

* The walk is bounded whatever the input: C-speed scans of the buffer (``bytes.find``,
  compiled regular expressions) plus at most ``limit + 1`` Python steps per counted unit; it
  allocates nothing in proportion to the input.
* It follows the decoders' own rules where they are lenient (libjpeg skips stray bytes before a
  marker and ``0xFF`` fill bytes; a marker inside entropy-coded data is any ``0xFF`` not
  followed by ``0x00`` or a restart marker), so what it counts is what the decoder will do. A
  structure it cannot follow to the end (a truncated file) is counted as far as it goes: the
  decoder refuses the rest.
* It only refuses (:class:`~vitserve.errors.ImageTooLargeError` naming the limit, the count and
  the limit); it never changes what a file decodes to.
* BMP is not walked: its decoders make one pass over the pixels, in C.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vitserve.errors import ImageTooLargeError

__all__ = ["DecodeWork", "check_decode_work", "decode_work"]

# A marker inside entropy-coded data: 0xFF followed by anything but a stuffed zero or a restart
# marker (0xD0-0xD7), which libjpeg handles inside the scan.
_JPEG_SCAN_END = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_JPEG_FILL = re.compile(rb"\xff+")
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})  # TEM, RSTn, SOI: no length field
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class DecodeWork:
    """What a file's structure makes its decoder do beyond its pixels.

    ``scans``: JPEG scans (each a pass of libjpeg over the coefficients it touches);
    ``steps``: structural units the decoders step through one at a time, most of them in PIL's
    Python code (JPEG markers, and stray bytes before the first scan; PNG chunks; GIF blocks and
    sub-blocks before the first frame; WebP chunks).

    EXIF and ICC blocks are not counted: PIL keeps them as bytes and reads only the tags asked
    for (a 64 KiB EXIF block of 5000 overlapping 16 KB tags, orientation 6 among them, decoded
    in under 0.1 s here), so their work is bounded by their bytes.
    """

    scans: int = 0
    steps: int = 0


def decode_work(buffer: bytes, fmt: str, *, max_scans: int, max_steps: int) -> DecodeWork:
    """The work ``buffer`` (a file PIL opened as ``fmt``) will cost to decode. Counting stops
    once a count passes its ``max_*`` (the answer is then over the limit, not exact)."""
    if fmt == "JPEG":
        return _jpeg(buffer, max_scans, max_steps)
    if fmt == "PNG":
        return _png(buffer, max_steps)
    if fmt == "GIF":
        return _gif(buffer, max_steps)
    if fmt == "WEBP":
        return _webp(buffer, max_steps)
    return DecodeWork()  # BMP: one pass over the pixels, in C


def check_decode_work(
    buffer: bytes,
    fmt: str,
    index: int,
    *,
    max_scans: int,
    max_steps: int,
) -> DecodeWork:
    """:func:`decode_work`, refused (:class:`ImageTooLargeError` naming the limit) when a count
    passes its limit."""
    work = decode_work(buffer, fmt, max_scans=max_scans, max_steps=max_steps)
    for limit, value, allowed in (
        ("max_jpeg_scans", work.scans, max_scans),
        ("max_structure_steps", work.steps, max_steps),
    ):
        if value > allowed:
            raise ImageTooLargeError(index, limit, value, allowed)
    return work


def _jpeg(buf: bytes, max_scans: int, max_steps: int) -> DecodeWork:
    """Walk a JPEG's markers from SOI to EOI (or the end), as libjpeg reads them. Every marker
    is a step; before the first scan, so is every stray or fill byte (PIL reads them one at a
    time); after it, a run of them is one (libjpeg skips it in C)."""
    scans = steps = 0
    pos, end = 2, len(buf)  # after SOI
    while pos < end and scans <= max_scans and steps <= max_steps:
        if buf[pos] != 0xFF:  # stray bytes: libjpeg skips them to the next 0xFF
            found = buf.find(b"\xff", pos)
            found = end if found < 0 else found
            steps += 1 if scans else found - pos
            pos = found
            continue
        fill = _JPEG_FILL.match(buf, pos)
        assert fill is not None
        if fill.end() - pos > 1:
            steps += 1 if scans else fill.end() - pos - 1
        pos = fill.end() - 1  # the last 0xFF of a run of fill bytes
        if pos + 1 >= end:
            break
        marker = buf[pos + 1]
        pos += 2
        steps += 1
        if marker == 0xD9:  # EOI: the decoder stops here
            break
        if marker == 0x00 or marker in _JPEG_STANDALONE:
            continue
        if pos + 2 > end:
            break
        length = int.from_bytes(buf[pos : pos + 2], "big")
        pos += max(length, 2)
        if marker == 0xDA:  # SOS: the scan's entropy-coded data runs to the next marker
            scans += 1
            scan_end = _JPEG_SCAN_END.search(buf, pos)
            pos = end if scan_end is None else scan_end.start()
    return DecodeWork(scans=scans, steps=steps)


def _png(buf: bytes, max_steps: int) -> DecodeWork:
    """Count a PNG's chunks (PIL reads each in Python: before, between and after the pixels)."""
    if not buf.startswith(_PNG_SIGNATURE):
        return DecodeWork()
    steps = 0
    pos, end = len(_PNG_SIGNATURE), len(buf)
    while pos + 8 <= end and steps <= max_steps:
        length = int.from_bytes(buf[pos : pos + 4], "big")
        steps += 1
        if buf[pos + 4 : pos + 8] == b"IEND":
            break
        pos += 12 + length
    return DecodeWork(steps=steps)


def _gif(buf: bytes, max_steps: int) -> DecodeWork:
    """Count a GIF's blocks and sub-blocks before its first image (PIL reads each in Python;
    the first frame's own data is read by the C decoder)."""
    end = len(buf)
    if end < 13:
        return DecodeWork()
    flags = buf[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # after the global colour table
    steps = 0
    while pos < end and steps <= max_steps:
        introducer = buf[pos]
        steps += 1
        if introducer != 0x21:  # 0x2C: the first image; anything else: PIL stops reading
            break
        pos += 2  # introducer and label, then data sub-blocks up to a zero-length one
        while pos < end and steps <= max_steps:
            size = buf[pos]
            steps += 1
            pos += 1 + size
            if size == 0:
                break
    return DecodeWork(steps=steps)


def _webp(buf: bytes, max_steps: int) -> DecodeWork:
    """Count a WebP's chunks (libwebp reads them in C; counted so that this walk stays
    bounded: a real file has a few, an animation one a frame)."""
    pos, end, steps = 12, len(buf), 0
    while pos + 8 <= end and steps <= max_steps:
        steps += 1
        size = int.from_bytes(buf[pos + 4 : pos + 8], "little")
        pos += 8 + size + (size & 1)
    return DecodeWork(steps=steps)
