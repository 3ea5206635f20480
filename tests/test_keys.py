"""Content keys and model fingerprints."""

from __future__ import annotations

import re

from vitserve.keys import content_key, model_fingerprint

FP = model_fingerprint(model="m", weights="w", processor={"patch_size": 14}, dtype="fp32")


def test_key_is_full_256_bit_hex() -> None:
    key = content_key(b"image", FP)
    assert re.fullmatch(r"[0-9a-f]{64}", key)
    assert content_key(b"image", FP) == key
    assert content_key(bytearray(b"image"), FP) == key
    assert content_key(memoryview(b"image"), FP) == key


def test_key_changes_with_bytes_fingerprint_and_namespace() -> None:
    base = content_key(b"image", FP)
    other_fp = model_fingerprint(
        model="m", weights="w2", processor={"patch_size": 14}, dtype="fp32"
    )
    assert content_key(b"imagf", FP) != base
    assert content_key(b"image", other_fp) != base
    assert content_key(b"image", FP, "tenant-a") != base
    assert content_key(b"image", FP, "tenant-a") != content_key(b"image", FP, "tenant-b")


def test_fields_are_length_prefixed() -> None:
    # Moving bytes between namespace, fingerprint and image must never give the same key.
    assert content_key(b"c", "ab", "") != content_key(b"c", "b", "a")
    assert content_key(b"bc", "a", "") != content_key(b"c", "ab", "")


def test_fingerprint_covers_every_field_and_ignores_dict_order() -> None:
    kw = dict(model="m", weights="w", processor={"a": 1, "b": [1, 2]}, dtype="fp32")
    base = model_fingerprint(**kw)
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert model_fingerprint(**{**kw, "processor": {"b": (1, 2), "a": 1}}) == base
    for field, value in [
        ("model", "m2"),
        ("weights", "w2"),
        ("dtype", "bf16"),
        ("processor", {"a": 2, "b": [1, 2]}),
    ]:
        assert model_fingerprint(**{**kw, field: value}) != base
    assert model_fingerprint(**kw, settings={"feature_layer": -2}) != base
