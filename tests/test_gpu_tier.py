"""The rule for tests marked ``gpu`` (tests/gpu.py) and how the suite applies it
(tests/conftest.py): fast, no GPU needed (the machine's CUDA is replaced by a ``CudaProbe`` of
each kind).

Invariants checked here:
- ``gpu_precondition``: usable CUDA runs; no device skips with a reason naming what torch saw,
  unless ``VITSERVE_REQUIRE_GPU`` is true, which fails naming what is missing; a broken device
  fails whatever the variable says; a malformed variable fails.
- In a session: a skipped ``gpu`` test is counted as skipped, with that reason; a failing one
  is reported FAILED (its call), not skipped and not an error; neither has any fixture set
  up; ``gpu`` tests are in the fast tier (``-m "not heavy and not slow"`` keeps them) and
  ``-m gpu`` selects exactly them.
"""

from __future__ import annotations

import pytest

import tests.conftest as suite
from tests import gpu
from vitserve.encoder.device import CudaProbe

ABSENT = CudaProbe("absent", "torch.cuda.is_available() is False (torch 2.13.0+cpu)")
BROKEN = CudaProbe("broken", "a first CUDA op failed: RuntimeError: CUDA error: unknown error")
OK = CudaProbe("ok", "NVIDIA H100 80GB HBM3 (torch 2.13.0)", name="NVIDIA H100 80GB HBM3")


# -- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("require", [None, "", "0", "1", "true", "yes"])
def test_usable_cuda_runs_whatever_is_required(require: str | None) -> None:
    assert gpu.gpu_precondition(OK, require) is None


@pytest.mark.parametrize("require", [None, "", "0", "false", "no", " 0 "])
def test_no_device_skips_with_what_torch_saw_when_not_required(require: str | None) -> None:
    reason = gpu.gpu_precondition(ABSENT, require)
    assert reason is not None
    assert reason.startswith("no CUDA device: torch.cuda.is_available() is False")
    assert "VITSERVE_REQUIRE_GPU=1 (make test-gpu) fails instead" in reason


@pytest.mark.parametrize("require", ["1", "true", "YES"])
def test_no_device_fails_naming_what_is_missing_when_required(require: str) -> None:
    with pytest.raises(gpu.GpuPreconditionError) as failed:
        gpu.gpu_precondition(ABSENT, require)
    message = str(failed.value)
    assert message.startswith(f"VITSERVE_REQUIRE_GPU={require} (make test-gpu) but no CUDA")
    assert ABSENT.detail in message


@pytest.mark.parametrize("require", [None, "0", "1"])
def test_a_broken_device_fails_whatever_is_required(require: str | None) -> None:
    with pytest.raises(gpu.GpuPreconditionError, match="CUDA is broken on this machine: a first"):
        gpu.gpu_precondition(BROKEN, require)


@pytest.mark.parametrize("require", ["2", "on", "required"])
def test_a_malformed_requirement_fails_rather_than_being_ignored(require: str) -> None:
    for probe in (OK, ABSENT):
        with pytest.raises(gpu.GpuPreconditionError, match="expected 1 or 0"):
            gpu.gpu_precondition(probe, require)


# -- the rule in a session -----------------------------------------------------------------------
INNER = """
import pytest


@pytest.fixture
def costly():
    raise AssertionError("a fixture of a skipped gpu test was set up")


@pytest.mark.gpu
def test_on_gpu():
    pass


@pytest.mark.gpu
def test_on_gpu_with_a_fixture(costly):
    pass


def test_plain():
    pass
"""


def _run(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    probe: CudaProbe,
    require: str | None,
    *args: str,
) -> pytest.HookRecorder:
    import tests.reliability_table as table

    monkeypatch.setattr(table, "ROWS", [])  # the inner session reports none of this run's rows
    monkeypatch.setattr(gpu, "probe", lambda: probe)
    if require is None:
        monkeypatch.delenv(gpu.REQUIRE_ENV, raising=False)
    else:
        monkeypatch.setenv(gpu.REQUIRE_ENV, require)
    pytester.makepyfile(test_inner=INNER)
    quiet = "ignore::pytest.PytestUnknownMarkWarning"  # the inner session reads no pyproject
    return pytester.inline_run(*args, "-W", quiet, plugins=[suite])


def test_without_a_gpu_they_are_skipped_with_the_reason_in_the_fast_tier(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(pytester, monkeypatch, ABSENT, None, "-m", "not heavy and not slow")
    passed, skipped, failed = run.listoutcomes()
    assert [r.head_line for r in passed] == ["test_plain"]
    assert not failed  # the costly fixture never ran
    assert sorted(str(r.head_line) for r in skipped) == [
        "test_on_gpu",
        "test_on_gpu_with_a_fixture",
    ]
    for report in skipped:
        assert report.when == "setup"
        assert isinstance(report.longrepr, tuple)  # (path, line, message) of a skip
        assert report.longrepr[2] == f"Skipped: {gpu.gpu_precondition(ABSENT, None)}"


@pytest.mark.parametrize(
    ("probe", "require", "message"),
    [
        (ABSENT, "1", "VITSERVE_REQUIRE_GPU=1 (make test-gpu) but no CUDA device is visible: "),
        (BROKEN, None, "CUDA is broken on this machine: "),
    ],
    ids=["required-but-absent", "broken"],
)
def test_a_missing_required_or_broken_gpu_fails_the_test_naming_it(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    probe: CudaProbe,
    require: str | None,
    message: str,
) -> None:
    run = _run(pytester, monkeypatch, probe, require, "-m", "gpu")
    passed, skipped, failed = run.listoutcomes()
    assert not passed and not skipped
    # FAILED in the call, with only the message, and the fixture was never set up
    assert sorted(str(r.head_line) for r in failed) == ["test_on_gpu", "test_on_gpu_with_a_fixture"]
    for report in failed:
        assert report.when == "call"
        assert report.longreprtext.strip() == message + probe.detail
    deselected = {i.name for call in run.getcalls("pytest_deselected") for i in call.items}
    assert deselected == {"test_plain"}


def test_with_a_usable_gpu_they_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(pytester, monkeypatch, OK, "1", "-m", "gpu", "-k", "not with_a_fixture")
    run.assertoutcome(passed=1)
