"""The encoder on CUDA: whether CUDA works (``probe_cuda``, fast, with stand-ins for
``torch.cuda``), and, marked ``gpu`` (skipped without a GPU, see tests/gpu.py), the activation
budget read from device memory and the batching promise in bf16 on the device.

* ``probe_cuda`` tells a machine without a device (``absent``) from one whose device fails
  (``broken``: asking raised, or a first op raised) and from one where CUDA works (``ok``,
  with the device's name); it never raises.
* On a GPU, the default activation budget is ``GPU_BUDGET_FRACTION`` of the device's free
  memory when the engine starts (``torch.cuda.mem_get_info``), and follows it: memory taken
  by someone else shrinks the next engine's budget by that fraction of it.
* On a GPU, a bf16 batch of mixed sizes gives each image's embedding within
  ``BATCH_TOLERANCE_ULPS["bf16"]`` of encoding it alone, per family (the CPU twin is
  tests/encoder/test_families.py), in fewer forwards than images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vitserve.encoder.device import CudaProbe, probe_cuda
from vitserve.testing.models import FAMILIES


class FakeCuda:
    """A stand-in for ``torch.cuda``: ``available`` is what ``is_available()`` answers (an
    exception is raised instead)."""

    def __init__(self, available: bool | Exception, name: str = "Fake GPU 80GB") -> None:
        self.available = available
        self.name = name

    def is_available(self) -> bool:
        if isinstance(self.available, Exception):
            raise self.available
        return self.available

    def current_device(self) -> int:
        return 0

    def get_device_name(self, index: int) -> str:
        assert index == 0
        return self.name


def _fine() -> None:
    pass


def _fails() -> None:
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


# -- probe_cuda (fast; no GPU needed) ------------------------------------------------------------
def test_no_device_is_absent_and_says_what_torch_saw() -> None:
    probe = probe_cuda(FakeCuda(False), first_op=_fails)  # the op must not even be tried
    assert probe.state == "absent" and probe.name is None
    assert "torch.cuda.is_available() is False" in probe.detail
    assert "torch " in probe.detail  # its version and build


def test_this_machine_is_probed_without_raising() -> None:
    """The real ``torch.cuda`` here: a GPU machine is ``ok`` and names its card; a machine
    without one (a CPU build of torch, or no driver) is ``absent``, never an exception."""
    import torch

    probe = probe_cuda()
    if torch.cuda.is_available():
        assert probe.state == "ok", probe.detail
        assert probe.name == torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        assert probe.state == "absent" and "is_available() is False" in probe.detail
    if torch.version.cuda is None:
        assert "a build without CUDA" in probe.detail


def test_a_device_whose_first_op_raises_is_broken_naming_the_error() -> None:
    probe = probe_cuda(FakeCuda(True), first_op=_fails)
    assert probe.state == "broken" and probe.name is None
    assert "is_available() is True but a first CUDA op failed" in probe.detail
    assert "RuntimeError: CUDA error: no kernel image is available" in probe.detail


def test_the_default_first_op_is_a_real_cuda_op() -> None:
    """A stand-in that claims a device, with torch's real op: on a CPU build of torch the op
    raises, so the probe is ``broken`` (on a GPU machine the op runs and the probe is ok)."""
    import torch

    probe = probe_cuda(FakeCuda(True))
    assert probe.state == ("ok" if torch.cuda.is_available() else "broken"), probe.detail


def test_asking_for_a_device_that_raises_is_broken() -> None:
    probe = probe_cuda(FakeCuda(RuntimeError("CUDA driver initialization failed")))
    assert probe.state == "broken"
    assert "is_available() raised RuntimeError: CUDA driver initialization failed" in probe.detail


def test_a_working_device_is_ok_with_its_name() -> None:
    probe = probe_cuda(FakeCuda(True, name="NVIDIA H100 80GB HBM3"), first_op=_fine)
    assert probe == CudaProbe("ok", probe.detail, name="NVIDIA H100 80GB HBM3")
    assert probe.detail.startswith("NVIDIA H100 80GB HBM3 (torch ")


def test_a_torch_warning_while_looking_is_in_the_detail() -> None:
    class Warns(FakeCuda):
        def is_available(self) -> bool:
            import warnings

            warnings.warn("CUDA initialization: The NVIDIA driver is too old", stacklevel=1)
            return False

    probe = probe_cuda(Warns(False))
    assert probe.state == "absent"
    assert "torch warned: CUDA initialization: The NVIDIA driver is too old" in probe.detail


# -- on a GPU ------------------------------------------------------------------------------------
def _cuda_engine(model: Path, **kw: Any) -> Any:
    from vitserve.encoder.engine import EncoderEngine

    return EncoderEngine.from_pretrained(str(model), device="cuda", dtype="bf16", **kw)


@pytest.mark.gpu
def test_the_default_budget_is_a_fraction_of_free_device_memory(tiny_models) -> None:
    import torch

    from vitserve.encoder.device import (
        GPU_BUDGET_FRACTION,
        default_budget_bytes,
        free_memory_bytes,
    )

    device = torch.device("cuda", torch.cuda.current_device())
    slack = 64 * 2**20  # the allocator's rounding, the tiny model's weights, the driver's own
    torch.cuda.empty_cache()  # earlier tests' cached blocks: free to the driver, so it counts
    free, total = torch.cuda.mem_get_info(device)
    assert abs(free_memory_bytes(device) - free) <= slack
    assert abs(free_memory_bytes(torch.device("cuda")) - free) <= slack  # no index: current

    engine = _cuda_engine(tiny_models["qwen2_vl"])
    assert engine.device.type == "cuda"
    assert abs(engine.budget_bytes - GPU_BUDGET_FRACTION * free) <= slack
    assert engine.budget_bytes <= GPU_BUDGET_FRACTION * total

    # memory taken after the engine started (a block too big for any cached segment, so the
    # allocator asks the driver for it): the next default budget shrinks with it
    taken = min(free // 4, 8 * 2**30)
    block = torch.empty(taken, dtype=torch.uint8, device=device)
    try:
        shrunk = default_budget_bytes(device)
        assert abs((engine.budget_bytes - shrunk) - GPU_BUDGET_FRACTION * taken) <= slack
    finally:
        del block
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_batched_equals_alone_on_cuda(tiny_models, batching_limits, family: str) -> None:
    import torch

    from tests.image_inputs import mixed_set
    from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart

    images = [b for _, b in mixed_set()]
    engine = _cuda_engine(tiny_models[family], **batching_limits)
    before = engine.counters.forward_calls
    batched = engine.encode(images)
    forwards = engine.counters.forward_calls - before
    alone = [engine.encode([b])[0] for b in images]

    assert [e.key for e in batched] == [engine.key(b) for b in images]
    assert not torch.equal(batched[0].tensor, batched[2].tensor)  # same size, other content
    ulps = 0.0
    for x, y in zip(batched, alone, strict=True):
        assert x.tensor.device.type == "cuda" and x.tensor.dtype == torch.bfloat16
        assert x.tensor.shape[0] == x.num_tokens and x.tensor.is_contiguous()
        assert set(x.extras) == set(y.extras)
        ulps = max(
            [ulps, ulps_apart(x.tensor, y.tensor)]
            + [ulps_apart(x.extras[k], y.extras[k]) for k in x.extras]
        )
    print(
        f"\n{family} bf16 on {torch.cuda.get_device_name()}: batched ({forwards} forwards for "
        f"{len(images)} images) vs alone: {ulps:.3g} ulps "
        f"(promise: {BATCH_TOLERANCE_ULPS['bf16']:g})"
    )
    assert ulps <= BATCH_TOLERANCE_ULPS["bf16"]
    assert forwards < len(images)
