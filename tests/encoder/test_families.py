"""Per family: the engine's two numerical contracts, asserted as stated and printed as measured.

* **Batched vs alone** (the engine's promise, see ``vitserve.encoder.engine``): batching changes
  an embedding by rounding only, at most ``BATCH_TOLERANCE_ULPS[dtype]`` ulps of its scale
  (:func:`ulps_apart`), tested in fp32 and in bf16. Not bit-equality: the CPU's matrix kernels
  choose their summation order by the shape of the whole batch.
* **Vision-only vs transformers' full model** (``get_image_features``): an independent reference
  that runs other shapes through the BLAS, so fp32 within ``REFERENCE_ULPS_PER_LAYER`` ulps for
  each layer an image passes (tower depth, patch embedding, projector): 16 ulps, ~2e-6 of the
  scale, at the test models' depth 2. Measured on an AMX Xeon: up to 5.1 ulps for the Qwen
  families (Qwen3-VL's deepstack features), 0 for LLaVA and Gemma 3.

Both bounds sit orders of magnitude below what a real fault does, and the tests below inject
two to show it: a rotary/position table shifted by one row moves the embeddings by 6-23% of
their scale (over 5e5 fp32 ulps; over 8 bf16 ulps), and an attention mask that lets packed
images see each other moves the batched embeddings far outside the bf16 batch bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.image_inputs import mixed_set
from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, EncoderEngine, ulps_apart
from vitserve.encoder.images import decode_image
from vitserve.testing.images import make_image
from vitserve.testing.models import FAMILIES, full_model_class

pytestmark = pytest.mark.cpu_profile  # CI runs it again as on each CPU profile

MIXED = mixed_set()
IMAGES = [b for _, b in MIXED]
# Sixteen small images of one size (the fault tests' load): on an AMX Xeon the Qwen families'
# fp32 rows of such a batch were 4.2-5.3 ulps from each image alone, where the mixed set's were 0.
SMALL = [make_image(64, 48, seed=7_100_000 + i) for i in range(16)]
QWEN = [f for f in FAMILIES if f.startswith("qwen")]
BUDGET = ["gemma4"]  # sized under a patch budget, padded to it
# Rounding per layer an image passes, against an independent fp32 reference.
REFERENCE_ULPS_PER_LAYER = 4.0


def _ulps(x, y) -> float:
    """The larger of the embedding's and its extras' distances, in ulps of ``y``'s scale."""
    assert set(x.extras) == set(y.extras)
    return max(
        [ulps_apart(x.tensor, y.tensor)] + [ulps_apart(x.extras[k], y.extras[k]) for k in x.extras]
    )


def reference_tolerance(engine: EncoderEngine) -> float:
    """The fp32 bound against the full model: per layer, plus patch embedding and projector."""
    return REFERENCE_ULPS_PER_LAYER * (engine.adapter.tower_shape.depth + 2)


@pytest.fixture(scope="module")
def references(tiny_models):
    """family -> transformers' own fp32 ``get_image_features`` output for IMAGES (cached)."""
    from transformers import AutoImageProcessor

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            path = tiny_models[family]
            model = full_model_class(family).from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa"
            )
            processor = AutoImageProcessor.from_pretrained(path)
            inputs = processor(images=[decode_image(b) for b in IMAGES], return_tensors="pt")
            # The processor's per-image layout: Qwen's grids, Gemma 4's patch positions.
            layout = {k: inputs[k] for k in ("image_grid_thw", "image_position_ids") if k in inputs}
            with torch.no_grad():
                cache[family] = model.eval().model.get_image_features(
                    inputs["pixel_values"], **layout
                )
        return cache[family]

    return get


def _reference_ulps(ours: list, ref) -> float:
    diffs = [ulps_apart(e.tensor, ref.pooler_output[i]) for i, e in enumerate(ours)]
    for j, feats in enumerate(getattr(ref, "deepstack_features", None) or []):
        diffs += [ulps_apart(e.extras[f"deepstack_{j}"], feats[i]) for i, e in enumerate(ours)]
    return max(diffs)


# -- injected faults ----------------------------------------------------------------------------
@contextlib.contextmanager
def shifted_positions(engine: EncoderEngine) -> Iterator[None]:
    """Every patch takes its neighbour's position: Qwen's rotary table rolled by one row, a
    CLIP/SigLIP tower's position ids rolled by one, or Gemma 4's position tables rolled by one
    row."""
    tower = engine.adapter.modules["tower"]
    if engine.family in QWEN:
        hook = tower.rotary_pos_emb.register_forward_hook(
            lambda _m, _i, out: tuple(t.roll(1, 0) for t in out)
        )
        try:
            yield
        finally:
            hook.remove()
        return
    # Gemma 4: its (x, y) position embedding tables; CLIP/SigLIP: their position ids.
    ids = (
        tower.patch_embedder.position_embedding_table
        if engine.family in BUDGET
        else tower.embeddings.position_ids
    )
    original = ids.clone()
    ids.copy_(ids.roll(1, 1))  # along the positions ([1, n] ids, [2, n, width] tables)
    try:
        yield
    finally:
        ids.copy_(original)


@contextlib.contextmanager
def mask_leaking_across_images(engine: EncoderEngine) -> Iterator[None]:
    """Every attention block of a packed Qwen tower sees the whole packed sequence as one
    image (``cu_seqlens`` reduced to its ends)."""

    def leak(_module, args, kwargs):
        kwargs["cu_seqlens"] = kwargs["cu_seqlens"][[0, -1]]
        return args, kwargs

    tower = engine.adapter.modules["tower"]
    hooks = [b.register_forward_pre_hook(leak, with_kwargs=True) for b in tower.blocks]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


# -- batched vs alone ---------------------------------------------------------------------------
@pytest.mark.parametrize("image_set", ["mixed", "small"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone_within_the_engines_promise(
    engines, bf16_engines, family: str, dtype: str, image_set: str
) -> None:
    engine = (engines if dtype == "fp32" else bf16_engines)[family]
    images = {"mixed": IMAGES, "small": SMALL}[image_set]
    before = engine.counters.forward_calls
    batched = engine.encode(images)
    forwards = engine.counters.forward_calls - before
    alone = [engine.encode([b])[0] for b in images]

    # Order: result i is image i (keys are per-content), and different images differ.
    assert [e.key for e in batched] == [engine.key(b) for b in images]
    assert len({e.key for e in batched}) == len(images)
    assert not torch.equal(batched[0].tensor, batched[2].tensor)  # same size, other content

    ulps = max(_ulps(x, y) for x, y in zip(batched, alone, strict=True))
    print(
        f"\n{family} {dtype}: batched ({forwards} forwards for {len(images)} images) vs "
        f"alone: {ulps:.3g} ulps (promise: {BATCH_TOLERANCE_ULPS[dtype]:g})"
    )
    assert ulps <= BATCH_TOLERANCE_ULPS[dtype]
    assert forwards < len(images)  # the fixture's cap and budget hold several images
    assert batched[0].tensor.dtype == engine.dtype
    for e in batched:
        assert e.tensor.shape[0] == e.num_tokens
        assert e.tensor.is_contiguous()
        if family in QWEN:
            t, h, w = e.grid
            assert t * h * w == 4 * e.num_tokens
        elif family in BUDGET:  # patches before the 3 x 3 pooling
            t, h, w = e.grid
            assert (t, h % 3, w % 3) == (1, 0, 0) and h * w == 9 * e.num_tokens
        else:
            assert e.grid is None
    if family == "qwen3_vl":
        assert set(batched[0].extras) == {"deepstack_0", "deepstack_1"}


def test_the_same_batch_again_gives_the_same_bits(engines, bf16_engines) -> None:
    """Exact, by design: the same shapes run the same kernels in the same order."""
    for engine in (engines["qwen3_vl"], bf16_engines["qwen2_5_vl"]):
        first = [e.tensor.clone() for e in engine.encode(IMAGES)]
        again = [e.tensor for e in engine.encode(IMAGES)]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("family", QWEN)
def test_a_mask_leaking_across_packed_images_breaks_the_batch_promise(
    bf16_engines, family: str
) -> None:
    """The bf16 bound (the looser of the two) still fails a packed forward whose images
    attend to each other, by a wide margin."""
    engine = bf16_engines[family]
    with mask_leaking_across_images(engine):
        batched = engine.encode(IMAGES)
        alone = [engine.encode([b])[0] for b in IMAGES]
    ulps = max(_ulps(x, y) for x, y in zip(batched, alone, strict=True))
    print(f"\n{family} bf16 with a leaking mask: batched vs alone {ulps:.3g} ulps")
    assert ulps > 10 * BATCH_TOLERANCE_ULPS["bf16"]


# -- vision-only vs the full model ----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_only_equals_full_model_within_fp32_rounding(
    engines, references, family: str
) -> None:
    engine = engines[family]
    ulps = _reference_ulps(engine.encode(IMAGES), references(family))
    tolerance = reference_tolerance(engine)
    report = engine.load_report
    print(
        f"\n{family}: vision-only vs full get_image_features: {ulps:.3g} ulps "
        f"(bound {tolerance:g}); read {report.bytes_read} of {report.checkpoint_bytes} "
        f"checkpoint bytes ({report.bytes_read / report.checkpoint_bytes:.1%}), "
        f"{len(report.shards_read)} of {report.shards_total} shards"
    )
    assert ulps <= tolerance


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shifted_position_fails_the_full_model_check_by_orders_of_magnitude(
    engines, references, family: str
) -> None:
    engine = engines[family]
    with shifted_positions(engine):
        shifted = _reference_ulps(engine.encode(IMAGES), references(family))
    restored = _reference_ulps(engine.encode(IMAGES), references(family))
    tolerance = reference_tolerance(engine)
    print(
        f"\n{family}: shifted positions {shifted:.3g} ulps from the full model "
        f"(bound {tolerance:g}, {shifted / tolerance:.2g}x over it)"
    )
    assert shifted > 1000 * tolerance
    assert restored <= tolerance  # the injection is undone
