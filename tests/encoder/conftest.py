"""Fixtures of the encoder's tests."""

from __future__ import annotations

import pytest
from PIL import ImageFile


@pytest.fixture
def load_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every pixel decode (``ImageFile.load``) made during the test."""
    calls: list[str] = []
    original = ImageFile.ImageFile.load

    def spy(self: ImageFile.ImageFile):  # type: ignore[no-untyped-def]
        calls.append(f"{self.format} {self.size}")
        return original(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return calls
