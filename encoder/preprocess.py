"""The CPU half of encoding: bytes -> decoded RGB (limits first) -> the family's pixel arrays.

Needs the model's config and image processor only, never its weights, so it can run in CPU
workers that scale apart from the encoder. Its output, a :class:`PreparedImage`, is plain numpy:
it crosses process boundaries (the Ray object store) without being copied.
"""

from __future__ import annotations

from vitserve.encoder.families import FamilyAdapter, PreparedImage
from vitserve.encoder.images import DEFAULT_LIMITS, ImageLimits, decode_image
from vitserve.encoder.loading import load_preprocessor
from vitserve.errors import ImagePreprocessError


class Preprocessor:
    def __init__(self, adapter: FamilyAdapter, limits: ImageLimits = DEFAULT_LIMITS) -> None:
        self.adapter = adapter
        self.limits = limits

    @classmethod
    def from_pretrained(
        cls, model: str, *, revision: str | None = None, limits: ImageLimits = DEFAULT_LIMITS
    ) -> Preprocessor:
        return cls(load_preprocessor(model, revision=revision), limits)

    def prepare(
        self, data: bytes | bytearray | memoryview, key: str, index: int = 0
    ) -> PreparedImage:
        """Decode (limits checked first) and preprocess one image; raises ImageError."""
        image = decode_image(data, index=index, limits=self.limits)
        try:
            return self.adapter.preprocess(image, key)
        except Exception as exc:
            raise ImagePreprocessError(index, f"{type(exc).__name__}: {exc}") from exc
