"""When a test marked ``gpu`` runs, skips or fails: one rule, applied by tests/conftest.py.

A ``gpu`` test runs a CUDA path (publishing from a CUDA tensor, the SDK's pinned-memory fetch,
the budget from device memory, a bf16 forward on the device). Without a GPU it is skipped, and
counted so (``-ra`` prints the reason); ``make test-gpu`` sets ``VITSERVE_REQUIRE_GPU=1`` so
that a machine meant to have one fails instead of passing on skips.

Invariants (:func:`gpu_precondition`):

* CUDA usable (a device is visible and a first op on it computed): the test runs.
* No device visible: skipped, with a reason that says what torch saw, unless
  ``VITSERVE_REQUIRE_GPU`` is set true; then the test fails naming what is missing.
* A device visible but broken (a first op raised, or asking raised): the test fails, whatever
  ``VITSERVE_REQUIRE_GPU`` says. A broken CUDA path is never a skip.
* A malformed ``VITSERVE_REQUIRE_GPU`` fails the test: the variable is never ignored.
"""

from __future__ import annotations

import functools

from vitserve.encoder.device import CudaProbe, probe_cuda

REQUIRE_ENV = "VITSERVE_REQUIRE_GPU"
_FLAGS = {"": False, "0": False, "false": False, "no": False}
_FLAGS |= {"1": True, "true": True, "yes": True}


class GpuPreconditionError(Exception):
    """A ``gpu`` test must fail, not skip: its message says what is missing or broken."""


def gpu_precondition(probe: CudaProbe, require: str | None) -> str | None:
    """What a ``gpu`` test does on a machine where CUDA looks like ``probe``, with ``require``
    the value of ``VITSERVE_REQUIRE_GPU`` (None: unset): None to run, else the reason to skip.
    Raises :class:`GpuPreconditionError` when the test must fail instead (see the module)."""
    raw = (require or "").strip().lower()
    if raw not in _FLAGS:
        raise GpuPreconditionError(f"{REQUIRE_ENV}={require!r}: expected 1 or 0 (true/false)")
    if probe.state == "ok":
        return None
    if probe.state == "broken":
        raise GpuPreconditionError(f"CUDA is broken on this machine: {probe.detail}")
    if _FLAGS[raw]:
        raise GpuPreconditionError(
            f"{REQUIRE_ENV}={require} (make test-gpu) but no CUDA device is visible: {probe.detail}"
        )
    return f"no CUDA device: {probe.detail}; {REQUIRE_ENV}=1 (make test-gpu) fails instead"


@functools.cache
def probe() -> CudaProbe:
    """This process's :func:`probe_cuda`, once (CUDA's start costs seconds; tests of the rule
    replace this function)."""
    return probe_cuda()
