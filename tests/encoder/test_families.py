"""Per family: batched encoding equals encoding each image alone, in input order, and equals
the full transformers model's own ``get_image_features``."""

from __future__ import annotations

import pytest
import torch

from vitserve.encoder.images import decode_image
from vitserve.encoder.testimages import mixed_set
from vitserve.encoder.testmodels import FAMILIES, full_model_class

MIXED = mixed_set()
IMAGES = [b for _, b in MIXED]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _embedding_diff(x, y) -> float:
    diffs = [_max_diff(x.tensor, y.tensor)]
    assert set(x.extras) == set(y.extras)
    diffs += [_max_diff(x.extras[k], y.extras[k]) for k in x.extras]
    return max(diffs)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_fp32(engines, family: str) -> None:
    engine = engines[family]
    before = engine.counters.forward_calls
    batched = engine.encode(IMAGES)
    forwards = engine.counters.forward_calls - before
    alone = [engine.encode([b])[0] for b in IMAGES]

    # Order: result i is image i (keys are per-content), and different images differ.
    assert [e.key for e in batched] == [engine.key(b) for b in IMAGES]
    assert len({e.key for e in batched}) == len(IMAGES)
    assert _max_diff(batched[0].tensor, batched[2].tensor) > 0  # same size, different content

    diff = max(_embedding_diff(x, y) for x, y in zip(batched, alone, strict=True))
    print(
        f"\n{family} fp32: batched ({forwards} forwards for {len(IMAGES)} images) "
        f"vs alone: max|diff| = {diff}"
    )
    assert diff == 0.0
    assert forwards < len(IMAGES)
    for e in batched:
        assert e.tensor.shape[0] == e.num_tokens
        assert e.tensor.is_contiguous()
        if family.startswith("qwen"):
            t, h, w = e.grid
            assert t * h * w == 4 * e.num_tokens
        else:
            assert e.grid is None
    if family == "qwen3_vl":
        assert set(batched[0].extras) == {"deepstack_0", "deepstack_1"}


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_bf16(tiny_models, family: str) -> None:
    """bf16 within a stated tolerance: the CPU GEMM may block a batch differently."""
    from vitserve.encoder.engine import EncoderEngine

    engine = EncoderEngine.from_pretrained(str(tiny_models[family]), device="cpu", dtype="bf16")
    images = IMAGES[:5]
    batched = engine.encode(images)
    alone = [engine.encode([b])[0] for b in images]
    assert batched[0].tensor.dtype == torch.bfloat16
    diff = max(_embedding_diff(x, y) for x, y in zip(batched, alone, strict=True))
    scale = max(e.tensor.float().abs().max().item() for e in alone)
    print(f"\n{family} bf16: batched vs alone: max|diff| = {diff} (max|value| {scale:.3g})")
    assert diff <= 1e-2 * scale


def _full_model(path, family):
    cls = full_model_class(family)
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_only_equals_full_model(tiny_models, engines, family: str) -> None:
    from transformers import AutoImageProcessor

    path = tiny_models[family]
    model = _full_model(path, family)
    processor = AutoImageProcessor.from_pretrained(path)
    pil = [decode_image(b) for b in IMAGES]
    inputs = processor(images=pil, return_tensors="pt")
    with torch.no_grad():
        if family.startswith("qwen"):
            ref = model.model.get_image_features(
                inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
            )
        else:
            ref = model.model.get_image_features(inputs["pixel_values"])
    ours = engines[family].encode(IMAGES)
    diffs = [_max_diff(e.tensor, ref.pooler_output[i]) for i, e in enumerate(ours)]
    if family == "qwen3_vl":
        for j, feats in enumerate(ref.deepstack_features):
            diffs += [_max_diff(e.extras[f"deepstack_{j}"], feats[i]) for i, e in enumerate(ours)]
    report = engines[family].load_report
    print(
        f"\n{family}: vision-only vs full get_image_features: max|diff| = {max(diffs)}; "
        f"read {report.bytes_read} of {report.checkpoint_bytes} checkpoint bytes "
        f"({report.bytes_read / report.checkpoint_bytes:.1%}), "
        f"{len(report.shards_read)} of {report.shards_total} shards"
    )
    assert max(diffs) == 0.0
