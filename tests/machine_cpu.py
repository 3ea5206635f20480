"""The machine's CPU a test costs: every core's busy time, from /proc/stat, between the start
of the test's setup and the end of its teardown, recorded in its junit XML entry as the
property ``machine_cpu_s`` (tests/conftest.py) and summed by tests/durations.py.

A test's wall time says how long it waited; on a 2-vCPU machine the suite's budget is CPU, and
most of a deploying test's CPU is spent outside the pytest process (the raylet, Serve's
controller, replicas starting, child processes), where no per-process counter of pytest's
sees it. The machine's counter sees all of it, and also whatever else runs beside the test:
the figure is exact for a run alone on its machine (``make test`` in ``.ci/run``) and an upper
bound beside a background job.

Invariants:
- Busy time is user + nice + system + irq + softirq + steal of the aggregate ``cpu`` line, in
  seconds (``SC_CLK_TCK`` ticks); idle and iowait are not busy, and guest time is already in
  user.
- Where /proc/stat is missing or unreadable the reading is ``None`` and no property is written:
  never a made-up figure.
"""

from __future__ import annotations

import os
from pathlib import Path

PROPERTY = "machine_cpu_s"
STAT = Path("/proc/stat")
# the aggregate line's fields, in /proc/stat's order (proc(5))
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_BUSY = ("user", "nice", "system", "irq", "softirq", "steal")


def busy_seconds(stat: str, ticks_per_second: int) -> float:
    """Every core's busy seconds since boot, from /proc/stat's text."""
    for line in stat.splitlines():
        name, *values = line.split()
        if name == "cpu":
            ticks = dict(zip(_FIELDS, (int(v) for v in values), strict=False))
            return sum(ticks.get(field, 0) for field in _BUSY) / ticks_per_second
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def read(path: Path = STAT) -> float | None:
    """The machine's busy seconds now, or ``None`` where the counter cannot be read."""
    try:
        return busy_seconds(path.read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None
