"""glibc malloc tuning (``vitserve.encoder.device.tune_cpu_allocator``): what it changes in a
fresh process. Not a CPU-profile test (nothing here reads the profile), so it runs once per
suite; it measures the host's allocator and kernel, so a measurement disturbed by the rest of
the machine (one CI run's ``[True]`` saw every page fault again while another step ran beside
it) is taken again, up to ``ATTEMPTS`` times, and the best one is judged.

Judged once warm: tuned, the heap may grow a few times before a freed buffer is reused
(torch's 64-byte-aligned allocation needs a little more than the chunk a neighbour's split
left: measured on a 2-vCPU EPYC, ``[16430, 16384, 16384, 16384, 16384, 16384, 0, 0, ...]``,
the heap growing 64 MiB a step until then), so a process runs ``STEPS`` buffers and the last
three are judged; untuned, every one faults again (``mmap``/``munmap`` each time)."""

from __future__ import annotations

import subprocess
import sys

import pytest

ATTEMPTS = 3
STEPS = 16
CODE = (
    "import resource, torch\n"
    "from vitserve.encoder.device import tune_cpu_allocator\n"
    "assert tune_cpu_allocator() if {tuned} else True\n"
    "def faults():\n"
    "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "counts = []\n"
    f"for _ in range({STEPS}):\n"
    "    before = faults()\n"
    "    torch.ones(16 * 2**20).sum()\n"
    "    counts.append(faults() - before)\n"
    "print(max(counts[-3:]))\n"  # warm: the last three buffers, each the worst of them
)


def refaults(tuned: bool) -> int:
    code = CODE.format(tuned=tuned)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("tuned", [False, True])
def test_cpu_allocator_tuning_stops_refaulting_large_buffers(tuned: bool) -> None:
    """A freed 64 MiB buffer is reused (no new page faults) only after tune_cpu_allocator."""
    pages = 64 * 2**20 // 4096
    seen = []
    for _ in range(ATTEMPTS):
        seen.append(refaults(tuned))
        if (seen[-1] < pages // 10) == tuned:
            break
    print(f"tuned={tuned}: page faults of a reused 64 MiB buffer, per attempt: {seen}")
    if tuned:
        assert min(seen) < pages // 10
    else:
        assert max(seen) > pages // 2
