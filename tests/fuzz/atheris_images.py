"""Coverage-guided fuzz target (atheris + libFuzzer) for image decoding: the header check
(``image_size``) and the decode to RGB pixels (``decode_image``) of vitserve.encoder.images.

Run it (``tests/fuzz/test_atheris.py`` does, with a seed corpus of valid images)::

    .venv/bin/python tests/fuzz/atheris_images.py CORPUS_DIR -max_total_time=20 -timeout=10

A crash is anything but a clean ImageError refusal or a good image: another exception escaping,
an ImageError without the caller's index or a reason, a decoded image that is not loaded RGB
or is over the pixel limit, the header check and the decode disagreeing (the decode succeeds
where the header check refused, or with another pixel count), or, through libFuzzer's own
``-timeout`` and ``-rss_limit_mb``, a hang or a memory blow-up. libFuzzer then writes the input
to ``<artifact_prefix>crash-*`` (or ``timeout-*``, ``oom-*``) and exits non-zero.
"""

from __future__ import annotations

import sys
import warnings

import atheris

# Instrument vitserve and PIL's Python plugins (the parsers of headers and chunk structure), so
# that coverage of their branches guides the mutations; the codecs themselves are C.
# PIL imports its format plugins on first use: import those of the allowed formats (and the
# TIFF one, which parses EXIF) here, inside the hook.
with atheris.instrument_imports(include=["vitserve", "PIL"]):
    from PIL import (  # noqa: F401
        BmpImagePlugin,
        GifImagePlugin,
        ImageFile,
        JpegImagePlugin,
        PngImagePlugin,
        TiffImagePlugin,
        WebPImagePlugin,
    )

    from vitserve.encoder.images import ImageLimits, decode_image, image_size
    from vitserve.errors import ImageError

# Small limits: a header declaring more is refused before decoding, so the fuzzer spends its
# time on inputs that reach the decoders instead of allocating huge images.
LIMITS = ImageLimits(max_image_bytes=1 << 20, max_image_pixels=1 << 16)
INDEX = 7


def _refusal(exc: ImageError) -> None:
    if exc.index != INDEX or not exc.reason:
        raise AssertionError(f"ImageError without the caller's index or a reason: {exc!r}")


def fuzz_one_input(data: bytes) -> None:
    """One input through the header check and the decode; raises on any violated property."""
    size = None
    try:
        size = image_size(data, index=INDEX, limits=LIMITS)
    except ImageError as exc:
        _refusal(exc)
    try:
        image = decode_image(data, index=INDEX, limits=LIMITS)
    except ImageError as exc:
        _refusal(exc)
        return
    width, height = image.size
    if size is None or width * height != size[0] * size[1]:
        raise AssertionError(f"decoded {image.size} where the header check said {size}")
    if image.mode != "RGB" or width * height > LIMITS.max_image_pixels:
        raise AssertionError(f"decoded a {image.mode} {image.size} image")
    image.tobytes()  # the pixels are there (a lazily loaded image would decode here)


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")  # PIL warns about corrupt EXIF etc.; that is not a crash
    atheris.Setup(argv, fuzz_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
