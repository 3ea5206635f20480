"""The engine: bad images fail alone with their index, the budget splits batches, oversize
images run alone, outputs are views of the batch output, and defaults resolve sensibly."""

from __future__ import annotations

import pytest
import torch

from tests.image_inputs import bad_images, mixed_set
from vitserve.encoder.device import (
    BF16_ENV,
    LLC_ENV,
    cpu_batch_cap,
    cpu_has_native_bf16,
    default_dtype,
    default_max_batch_patches,
    describe_cpu,
    last_level_cache_bytes,
    parse_dtype,
    parse_size,
    resolve_device,
)
from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, Embedding, EncoderEngine, ulps_apart
from vitserve.errors import ConfigError, ImageDecodeError, ImageError, ImageTooLargeError
from vitserve.testing.images import make_image

pytestmark = pytest.mark.cpu_profile  # CI runs it again as on each CPU profile

GOOD = [b for _, b in mixed_set()[:4]]
EXPECTED = {
    "empty": (ImageDecodeError, "empty"),
    "truncated-jpeg": (ImageDecodeError, "truncated"),
    "text": (ImageDecodeError, "not a recognised image"),
    "bomb": (ImageTooLargeError, "max_image_pixels"),
    "declared-20000x20000": (ImageTooLargeError, "max_image_pixels"),
}


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_bad_images_fail_alone_with_their_index(engines, family) -> None:
    engine = engines[family]
    bad = bad_images()
    assert set(bad) == set(EXPECTED)
    # interleave: good, bad, good, bad, ...
    inputs: list[bytes] = []
    names: list[str | None] = []
    for good, (name, data) in zip(GOOD + GOOD[:1], bad.items(), strict=False):
        inputs += [good, data]
        names += [None, name]
    refused_before = engine.counters.refused
    results = engine.encode(inputs)
    assert len(results) == len(inputs)
    # Exact: without the bad images the good ones form the same batches, so the same kernels
    # run on the same shapes.
    reference = engine.encode([b for b, n in zip(inputs, names, strict=True) if n is None])
    good_results = iter(reference)
    for i, (result, name) in enumerate(zip(results, names, strict=True)):
        if name is None:
            assert isinstance(result, Embedding)
            assert torch.equal(result.tensor, next(good_results).tensor)
        else:
            cls, reason = EXPECTED[name]
            assert isinstance(result, cls), (name, result)
            assert result.index == i
            assert reason in result.reason
            assert f"image {i}:" in str(result)
    assert engine.counters.refused - refused_before == len(bad)


def test_budget_splits_batches_and_output_is_unchanged(engines) -> None:
    engine = engines["llava"]
    images = [make_image(300, 200, seed=s) for s in range(6)]
    prepared = engine.prepare(images)
    per_image = engine.adapter.activation_bytes(prepared[0])
    whole = engine.plan(prepared)
    assert whole.forward_calls == 1

    # The budget splits here, not the cap (set, as the fixture's, not taken from the host).
    small = EncoderEngine(
        engine.adapter,
        fingerprint=engine.fingerprint,
        budget_bytes=2 * per_image,
        max_batch_patches=engine.max_batch_patches,
    )
    plan = small.plan(prepared)
    assert plan.forward_calls == 3
    assert all(b.act_bytes <= 2 * per_image for b in plan.batches)
    split = small.run(prepared)
    assert small.counters.forward_calls == 3
    # Batches of 2 vs one of 6: other shapes, so the engine's promise, not bit-equality.
    for a, b in zip(split, engine.run(prepared), strict=True):
        assert ulps_apart(a.tensor, b.tensor) <= BATCH_TOLERANCE_ULPS["fp32"]


def test_oversize_image_runs_alone_and_is_counted(engines) -> None:
    engine = engines["qwen2_vl"]
    small_img = make_image(100, 100, seed=1)
    big_img = make_image(600, 600, seed=2)
    prepared = engine.prepare([small_img, big_img, small_img])
    budget = engine.adapter.activation_bytes(prepared[0]) * 3
    assert engine.adapter.activation_bytes(prepared[1]) > budget
    tight = EncoderEngine(
        engine.adapter,
        fingerprint=engine.fingerprint,
        budget_bytes=budget,
        max_batch_patches=engine.max_batch_patches,
    )
    out = tight.run(prepared)
    assert tight.counters.oversize == 1
    assert tight.counters.forward_calls == 2  # the two small ones together, the big one alone
    assert out[1].num_tokens > out[0].num_tokens
    # Exact: the oversize image ran alone, as it does here.
    assert torch.equal(out[1].tensor, engine.run([prepared[1]])[0].tensor)


def test_embeddings_are_views_of_the_batch_output(engines) -> None:
    engine = engines["qwen3_vl"]
    images = [make_image(200, 200, seed=s) for s in range(3)]
    out = engine.encode(images)
    storage = {e.tensor.untyped_storage().data_ptr() for e in out}
    assert len(storage) == 1  # one forward, three row slices of its output
    offsets = [e.tensor.storage_offset() for e in out]
    assert offsets == sorted(offsets) and len(set(offsets)) == 3
    assert all(e.tensor.is_contiguous() for e in out)


def test_prepared_pixels_are_not_copied(engines) -> None:
    engine = engines["gemma3"]
    p = engine.prepare_one(GOOD[0])
    assert p.pixels.base is not None  # a view into the processor's batch output
    assert p.pixels.dtype.name == "float32"


def test_counters_count_images_forwards_and_patches(engines) -> None:
    engine = engines["qwen2_5_vl"]
    before = (engine.counters.images, engine.counters.forward_calls, engine.counters.patches)
    out = engine.encode(GOOD)
    assert engine.counters.images - before[0] == len(GOOD)
    assert (
        engine.counters.forward_calls - before[1] == engine.plan(engine.prepare(GOOD)).forward_calls
    )
    assert engine.counters.patches - before[2] == sum(4 * e.num_tokens for e in out)


def test_preprocess_failure_is_an_image_error(engines) -> None:
    # Qwen's processor refuses aspect ratios above 200: decoded fine, cannot be patched.
    sliver = make_image(2000, 4, seed=3)
    [result] = engines["qwen2_vl"].encode([sliver])
    assert isinstance(result, ImageError)
    assert result.index == 0


def test_dtype_and_device_resolution() -> None:
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("fp32") is torch.float32
    with pytest.raises(ConfigError, match="unknown dtype"):
        parse_dtype("int8")
    with pytest.raises(ConfigError, match="invalid device"):
        resolve_device("tpu:banana")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")
    avx2 = "flags\t\t: fpu sse2 avx avx2 fma\n"
    amx = "flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    avx512_bf16 = "processor: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    assert not cpu_has_native_bf16(avx2)
    assert cpu_has_native_bf16(amx) and cpu_has_native_bf16(avx512_bf16)


@pytest.mark.parametrize("native", [True, False])
def test_the_default_dtype_follows_native_bf16(monkeypatch, native: bool) -> None:
    monkeypatch.setenv(BF16_ENV, "1" if native else "0")
    assert cpu_has_native_bf16() is native
    expected = torch.bfloat16 if native else torch.float32
    assert default_dtype(torch.device("cpu")) is expected


def test_identical_images_in_one_call_are_encoded_once(engines) -> None:
    engine = engines["gemma3"]
    a, b = make_image(120, 90, seed=11), make_image(120, 90, seed=12)
    before = engine.counters.images
    out = engine.encode([a, b, a, a])
    assert engine.counters.images - before == 2
    assert out[0] is out[2] is out[3]
    assert out[0].key != out[1].key


def test_the_cpu_batch_cap_is_a_function_of_cache_size_and_bf16_support() -> None:
    """The profiles seen on machines of this project's kind, as inputs, not as the host."""
    mib = 2**20
    # 8 MiB L3, AVX2 only: fp32 and bf16 alike are sized for 4-byte elements.
    assert cpu_batch_cap(8 * mib, False, 3072, 4) == 682  # below one 448px image (1024)
    assert cpu_batch_cap(8 * mib, False, 3072, 2) == 682
    # 32 MiB L3 with native bf16: bf16 elements take 2 bytes.
    assert cpu_batch_cap(32 * mib, True, 3072, 4) == 2730
    assert cpu_batch_cap(32 * mib, True, 3072, 2) == 5461
    # 480 MiB reported (an AMX Xeon): a cap far above any request.
    assert cpu_batch_cap(480 * mib, True, 3072, 2) == 81920
    assert cpu_batch_cap(None, True, 3072, 2) is None  # unknown cache: no cap
    assert cpu_batch_cap(1024, False, 3072, 4) == 1  # never zero


@pytest.mark.parametrize(
    ("llc", "bf16", "expected_fp32", "expected_bf16"),
    [("8MiB", "0", 682, 682), ("32MiB", "1", 2730, 5461)],
)
def test_the_host_readings_can_be_overridden(
    monkeypatch, engines, llc, bf16, expected_fp32, expected_bf16
) -> None:
    monkeypatch.setenv(LLC_ENV, llc)
    monkeypatch.setenv(BF16_ENV, bf16)
    cpu = torch.device("cpu")
    assert last_level_cache_bytes() == parse_size(llc)
    assert default_max_batch_patches(cpu, 3072, torch.float32) == expected_fp32
    assert default_max_batch_patches(cpu, 3072, torch.bfloat16) == expected_bf16
    assert default_max_batch_patches(torch.device("cuda"), 3072, torch.bfloat16) is None
    assert f"{llc[:-3]} MiB last-level cache (from {LLC_ENV})" in describe_cpu()
    # an engine without an explicit cap takes the default; an explicit one wins
    engine = engines["llava"]
    default = EncoderEngine(engine.adapter, fingerprint=engine.fingerprint)
    assert default.max_batch_patches == parse_size(llc) // (engine.adapter.tower_shape.mlp * 4)
    capped = EncoderEngine(engine.adapter, fingerprint=engine.fingerprint, max_batch_patches=400)
    prepared = capped.prepare([make_image(90, 90, seed=s) for s in range(5)])  # 196 patches each
    assert [b.num_items for b in capped.plan(prepared).batches] == [2, 2, 1]


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (LLC_ENV, "lots", "not a size"),
        (LLC_ENV, "0", "positive"),
        (BF16_ENV, "maybe", "1 or 0"),
    ],
)
def test_a_malformed_override_is_an_error_not_ignored(monkeypatch, name, value, message) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message) as info:
        default_max_batch_patches(torch.device("cpu"), 3072, torch.float32)
    assert name in str(info.value)


def test_sizes_parse_in_binary_units() -> None:
    assert parse_size("33554432") == parse_size("32MiB") == parse_size("32M") == 32 * 2**20
    assert parse_size("512k") == parse_size("512 KiB") == 512 * 2**10
    assert parse_size("1GB") == 2**30
    with pytest.raises(ValueError, match="not a size"):
        parse_size("8 MiB of cache")
