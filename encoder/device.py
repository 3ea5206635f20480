"""Device, dtype and activation-budget defaults, each overridable by the caller.

* Device: ``cuda`` when a GPU is visible, else ``cpu``.
* Dtype: bf16 on a GPU that supports it (else fp16), and on a CPU with native bf16 matmul
  (AVX512-BF16 or AMX-BF16); fp32 on other CPUs, where bf16 matmul is emulated and slow (on an
  AVX2-only CPU measured here: fp32 ~135 GFLOP/s, bf16 ~1.3 GFLOP/s for a 512x512 matmul).
* Budget: a fraction of the device memory that is free when the engine starts.
* CUDA readiness: :func:`probe_cuda` says whether CUDA works here (a device is visible and a
  first op on it computes), or what is missing or broken, in words: the ``gpu`` tests and
  ``loadtest/bench_gpu.py`` decide from it whether to run, skip or refuse.
* CPU batch cap: on a CPU, a batch's tokens are capped so that its MLP intermediate fits the
  last-level cache. One image of a few hundred patches already keeps the cores' matmul units
  busy, so bigger batches gain nothing there, while the elementwise ops between the matmuls
  (GELU, rotary products) become memory-bound once their tensors spill the cache: measured here
  (ViT-B, fp32, 32 MiB L3), packing seven 1156-patch images made ``mul``/``sigmoid`` 3-5x
  slower per image and the forward ~5% slower per image than one image alone. GPUs get no cap.

Host readings, and how to override them: two of these defaults read the host CPU, the size of
its last-level cache (Linux sysfs) and whether it multiplies bf16 natively (``/proc/cpuinfo``).
``VITSERVE_CPU_LLC_BYTES`` (a size: ``8MiB``, ``480M``, ``33554432``) and ``VITSERVE_CPU_BF16``
(``1``/``0``, ``true``/``false``) replace those readings, in this process and in the Ray workers
it starts, so a run (the test suite's CPU-profile passes, a benchmark) behaves as it would on
another CPU. A malformed value is a :class:`ConfigError`, never ignored. Only the decisions
change (default dtype, batch cap): the kernels that run are still the host's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vitserve.errors import ConfigError

DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# Share of free memory the activation budget may use: the rest holds weights, outputs waiting to
# be published, the allocator's slack and whatever else shares the device.
GPU_BUDGET_FRACTION = 0.5
CPU_BUDGET_FRACTION = 0.25

# Environment variables that replace a host reading (see the module docstring).
LLC_ENV = "VITSERVE_CPU_LLC_BYTES"
BF16_ENV = "VITSERVE_CPU_BF16"
HOST_OVERRIDE_VARS = (LLC_ENV, BF16_ENV)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def resolve_device(device: str | Any | None) -> Any:
    """``torch.device`` for ``device`` (``None``: cuda when available, else cpu)."""
    import torch  # heavy: deployments/common/config imports this module for its names

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but no CUDA device is available")
    return dev


def parse_dtype(dtype: str | Any) -> Any:
    """``torch.dtype`` from a name (fp32/bf16/fp16 or the torch names) or a torch dtype."""
    import torch  # heavy: deployments/common/config imports this module for its names

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"unsupported dtype {dtype}; use fp32, bf16 or fp16")
        return dtype
    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """The short name (fp32/bf16/fp16) of a torch dtype."""
    return SHORT_NAMES[str(dtype).removeprefix("torch.")]


def parse_size(text: str) -> int:
    """Bytes from ``8MiB``, ``8M``, ``8 MB``, ``512K`` or ``33554432`` (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 8MiB, 480M, 33554432)")
    return int(m[1]) * _UNITS[m[2].upper()]


def _overridden(name: str) -> bool:
    """Whether override variable ``name`` is set (an empty value counts as unset)."""
    return bool(os.environ.get(name, "").strip())


def _env_override(name: str, parse: Any) -> Any:
    """The parsed value of override variable ``name``, or None when it is unset or empty."""
    if not _overridden(name):
        return None
    raw = os.environ[name].strip()
    try:
        return parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r}: {exc}") from None


def _parse_flag(raw: str) -> bool:
    flags = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
    if raw.lower() not in flags:
        raise ValueError("expected 1 or 0 (true/false)")
    return flags[raw.lower()]


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 flags).

    With ``cpuinfo`` given, answers for that text; else ``$VITSERVE_CPU_BF16`` when set, else
    the host's ``/proc/cpuinfo``.
    """
    if cpuinfo is None:
        forced = _env_override(BF16_ENV, _parse_flag)
        if forced is not None:
            return bool(forced)
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def default_dtype(device: Any) -> Any:
    """bf16 where the device computes it natively, else fp16 (old GPUs) or fp32 (CPUs)."""
    import torch  # heavy: deployments/common/config imports this module for its names

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def free_memory_bytes(device: Any) -> int:
    """Free memory of ``device`` now (GPU: the driver's free bytes; CPU: MemAvailable)."""
    import torch  # heavy: deployments/common/config imports this module for its names

    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30  # unknown platform: assume a modest 4 GiB


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache: ``$VITSERVE_CPU_LLC_BYTES`` when set, else Linux sysfs; None
    when it cannot be read."""
    forced = _env_override(LLC_ENV, parse_size)
    if forced is not None:
        if forced <= 0:
            raise ConfigError(f"{LLC_ENV} must be a positive size, got {forced}")
        return int(forced)
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            sizes.append(parse_size((index / "size").read_text()))  # e.g. "32768K"
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


def cpu_batch_cap(
    llc_bytes: int | None, native_bf16: bool, mlp_width: int, itemsize: int
) -> int | None:
    """The CPU batch cap in patches (see the module docstring), from its inputs alone: as many
    tokens as fit one MLP intermediate (``mlp_width`` elements each) in the last-level cache;
    None (no cap) when the cache size is unknown.

    Sized for 4-byte elements unless the CPU computes 16-bit floats natively: without native
    bf16, bf16 layers run through fp32 conversions, and a cap sized for 2-byte elements
    measured 5% slower per image than one image at a time (0.94-0.95x in three rounds).
    """
    if not llc_bytes:
        return None
    element = itemsize if native_bf16 else max(4, itemsize)
    return max(1, llc_bytes // (mlp_width * element))


def default_max_batch_patches(device: Any, mlp_width: int, dtype: Any) -> int | None:
    """:func:`cpu_batch_cap` for this host (or its overrides); None (no cap) on GPUs."""
    if device.type != "cpu":
        return None
    return cpu_batch_cap(last_level_cache_bytes(), cpu_has_native_bf16(), mlp_width, dtype.itemsize)


def available_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may use: its CPU affinity, capped by its container's CPU quota
    (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, rounded up), not
    the host's core count (``os.cpu_count()``: 64 on a node where the pod may use 4)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    root = Path(cgroup_root)
    quota = period = None
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            quota, period = int(text[0]), int(text[1])
    except (OSError, ValueError, IndexError):
        try:
            q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
            p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            if q > 0 and p > 0:
                quota, period = q, p
        except (OSError, ValueError):
            pass
    if quota is not None and period:
        cores = min(cores, max(1, -(-quota // period)))
    return cores


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for results pages; ``unknown CPU`` elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                "unknown CPU",
            )
    except OSError:
        return "unknown CPU"


def describe_cpu() -> str:
    """The host readings behind the CPU defaults, naming the ones an override replaced."""

    def source(name: str) -> str:
        return f" (from {name})" if _overridden(name) else ""

    llc = last_level_cache_bytes()
    cache = f"{llc / 2**20:g} MiB last-level cache" if llc else "last-level cache unknown"
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{cache}{source(LLC_ENV)}, {bf16}{source(BF16_ENV)}"


@dataclass(frozen=True, slots=True)
class CudaProbe:
    """What :func:`probe_cuda` found. ``state``: ``ok`` (a device is visible and a first op on
    it computed), ``absent`` (torch sees no CUDA device) or ``broken`` (torch reports a device,
    but using it failed). ``detail`` says what was seen, in words (torch's build, the error,
    ``CUDA_VISIBLE_DEVICES``); ``name`` is the device's name when ``ok``."""

    state: Literal["ok", "absent", "broken"]
    detail: str
    name: str | None = None


def _first_cuda_op() -> None:
    """A first op on the current CUDA device, checked: raises when it fails or computes wrong."""
    import torch  # heavy: deployments/common/config imports this module for its names

    got = torch.ones(8, device="cuda").mul_(2).sum().item()
    torch.cuda.synchronize()
    if got != 16.0:
        raise RuntimeError(f"torch.ones(8).mul_(2).sum() on cuda gave {got}, not 16.0")


def _torch_build() -> str:
    import torch  # heavy: deployments/common/config imports this module for its names

    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"torch {torch.__version__}, {built}" + (
        f"; CUDA_VISIBLE_DEVICES={seen!r}" if seen is not None else ""
    )


def probe_cuda(cuda: Any = None, first_op: Callable[[], object] | None = None) -> CudaProbe:
    """Whether CUDA works in this process: ``cuda.is_available()``, then a first op on the
    device (``first_op``; by default a small computation checked on the host) and its name.

    ``cuda`` defaults to ``torch.cuda`` (tests pass a stand-in). Never raises: an exception of
    torch's becomes a ``broken`` probe naming it, and a warning torch gives while looking for
    a device (an old driver, say) is part of an ``absent`` probe's detail. Initializes CUDA
    when a device is visible (seconds, once per process).
    """
    import torch  # heavy: deployments/common/config imports this module for its names

    cuda = torch.cuda if cuda is None else cuda
    op = _first_cuda_op if first_op is None else first_op
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            visible = bool(cuda.is_available())
    except Exception as exc:  # a driver or runtime that fails when asked at all
        return CudaProbe("broken", f"torch.cuda.is_available() raised {_named(exc)}")
    if not visible:
        warned = "".join(f"; torch warned: {w.message}" for w in said)
        return CudaProbe("absent", f"torch.cuda.is_available() is False ({_torch_build()}{warned})")
    try:
        op()
        name = str(cuda.get_device_name(cuda.current_device()))
    except Exception as exc:
        return CudaProbe(
            "broken",
            f"torch.cuda.is_available() is True but a first CUDA op failed: {_named(exc)} "
            f"({_torch_build()})",
        )
    return CudaProbe("ok", f"{name} ({_torch_build()})", name=name)


def _named(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def default_budget_bytes(device: Any) -> int:
    """The activation budget when none is given: a fraction of the free device memory."""
    fraction = GPU_BUDGET_FRACTION if device.type == "cuda" else CPU_BUDGET_FRACTION
    return max(1, int(free_memory_bytes(device) * fraction))


_ALLOCATOR_TUNED = False
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def tune_cpu_allocator(trim_threshold_bytes: int = 1 << 30) -> bool:
    """Make glibc malloc keep large freed buffers for reuse (process-wide; once; Linux only).

    By default glibc serves each allocation above its mmap threshold (a few MiB, adjusted at run
    time) with a fresh ``mmap`` and unmaps it on free, so every packed forward pays page faults
    on its activation buffers again: measured here, a 7-image packed ViT-B forward took ~150k
    minor faults per image and ran slower per image than one image alone. With mmap off for
    allocations and a 1 GiB trim threshold, the faults vanish and the packed forward is 6-11%
    faster per image than one alone. Returns whether the settings took effect.
    """
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): leave the allocator alone
        return False
    _ALLOCATOR_TUNED = bool(mallopt(M_MMAP_MAX, 0)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold_bytes)
    )
    return _ALLOCATOR_TUNED
