"""The engine: bad images fail alone with their index, the budget splits batches, oversize
images run alone, outputs are views of the batch output, and defaults resolve sensibly."""

from __future__ import annotations

import pytest
import torch

from vitserve.encoder.device import (
    cpu_has_native_bf16,
    default_dtype,
    parse_dtype,
    resolve_device,
)
from vitserve.encoder.engine import Embedding, EncoderEngine
from vitserve.encoder.testimages import bad_images, make_image, mixed_set
from vitserve.errors import ConfigError, ImageDecodeError, ImageError, ImageTooLargeError

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

    small = EncoderEngine(engine.adapter, fingerprint=engine.fingerprint,
                          budget_bytes=2 * per_image)  # fmt: skip
    plan = small.plan(prepared)
    assert plan.forward_calls == 3
    assert all(b.act_bytes <= 2 * per_image for b in plan.batches)
    split = small.run(prepared)
    assert small.counters.forward_calls == 3
    for a, b in zip(split, engine.run(prepared), strict=True):
        assert torch.equal(a.tensor, b.tensor)


def test_oversize_image_runs_alone_and_is_counted(engines) -> None:
    engine = engines["qwen2_vl"]
    small_img = make_image(100, 100, seed=1)
    big_img = make_image(600, 600, seed=2)
    prepared = engine.prepare([small_img, big_img, small_img])
    budget = engine.adapter.activation_bytes(prepared[0]) * 3
    assert engine.adapter.activation_bytes(prepared[1]) > budget
    tight = EncoderEngine(engine.adapter, fingerprint=engine.fingerprint, budget_bytes=budget)
    out = tight.run(prepared)
    assert tight.counters.oversize == 1
    assert tight.counters.forward_calls == 2  # the two small ones together, the big one alone
    assert out[1].num_tokens > out[0].num_tokens
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
    assert not cpu_has_native_bf16(avx2)
    assert cpu_has_native_bf16(amx)
    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert default_dtype(torch.device("cpu")) is expected


def test_identical_images_in_one_call_are_encoded_once(engines) -> None:
    engine = engines["gemma3"]
    a, b = make_image(120, 90, seed=11), make_image(120, 90, seed=12)
    before = engine.counters.images
    out = engine.encode([a, b, a, a])
    assert engine.counters.images - before == 2
    assert out[0] is out[2] is out[3]
    assert out[0].key != out[1].key


@pytest.mark.parametrize("tuned", [False, True])
def test_cpu_allocator_tuning_stops_refaulting_large_buffers(tuned: bool) -> None:
    """A freed 64 MiB buffer is reused (no new page faults) only after tune_cpu_allocator."""
    import subprocess
    import sys

    code = (
        "import resource, torch\n"
        "from vitserve.encoder.device import tune_cpu_allocator\n"
        f"assert tune_cpu_allocator() if {tuned} else True\n"
        "def faults():\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "counts = []\n"
        "for _ in range(6):\n"  # the first uses fault in any case; take the best later one
        "    before = faults()\n"
        "    torch.ones(16 * 2**20).sum()\n"
        "    counts.append(faults() - before)\n"
        "print(min(counts[2:]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    refaults = int(out.stdout.split()[-1])
    pages = 64 * 2**20 // 4096
    if tuned:
        assert refaults < pages // 10
    else:
        assert refaults > pages // 2


def test_cpu_batches_are_capped_to_the_last_level_cache(engines) -> None:
    from vitserve.encoder.device import default_max_batch_patches, last_level_cache_bytes

    llc = last_level_cache_bytes()
    assert default_max_batch_patches(torch.device("cuda"), 3072, torch.bfloat16) is None
    if llc is None:
        pytest.skip("no cache sizes in sysfs")
    cpu = torch.device("cpu")
    assert default_max_batch_patches(cpu, 3072, torch.float32) == llc // (3072 * 4)
    bf16_item = 2 if cpu_has_native_bf16() else 4
    assert default_max_batch_patches(cpu, 3072, torch.bfloat16) == llc // (3072 * bf16_item)
    engine = engines["llava"]
    assert engine.max_batch_patches == llc // (engine.adapter.tower_shape.mlp * 4)
    capped = EncoderEngine(engine.adapter, fingerprint=engine.fingerprint, max_batch_patches=400)
    prepared = capped.prepare([make_image(90, 90, seed=s) for s in range(5)])  # 196 patches each
    assert [b.num_items for b in capped.plan(prepared).batches] == [2, 2, 1]
