"""The images a caller passes, as the bytes the service keys and decodes."""

from __future__ import annotations

import io
import os
from typing import Any

from vitserve.errors import ImageDecodeError, MalformedRequestError

ImageInput = Any  # bytes-like, a path (str or os.PathLike) or a PIL image


def image_bytes(image: ImageInput, index: int) -> bytes:
    """The bytes of one input image: bytes-likes as they are, a file's contents, a PIL image
    saved as PNG (lossless; the key is then that PNG's). A path that cannot be read is an
    ImageDecodeError of that image; any other type a MalformedRequestError."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, (bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ImageDecodeError(index, f"cannot read {os.fspath(image)!r}: {exc}") from None
    if hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image (PIL imported by caller)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise MalformedRequestError(
        f"image {index}: expected bytes, a path or a PIL image, got {type(image).__name__}"
    )


__all__ = ["ImageInput", "image_bytes"]
