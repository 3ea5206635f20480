"""The idle-cost benchmark's accounting (``loadtest/bench_idle.py``), without a server: a
process tree's CPU and wakeups per role, and the page's ratios against nothing beside."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from loadtest import bench_idle as b

_SPIN = "import time\nt = time.time()\nwhile time.time() - t < 2: pass\ntime.sleep(60)"
_WAKE = "import time\nwhile True: time.sleep(0.005)"


def test_a_trees_cpu_and_wakeups_are_counted_per_process() -> None:
    spin = subprocess.Popen([sys.executable, "-c", _SPIN])
    wake = subprocess.Popen([sys.executable, "-c", _WAKE])
    try:
        time.sleep(0.3)
        got = {}
        for proc in (spin, wake):
            roles = b.idle_by_role(proc.pid, 1.0)
            assert len(roles) == 1, roles  # one process, no children
            got[proc] = next(iter(roles.values()))
    finally:
        for proc in (spin, wake):
            proc.kill()
            proc.wait()
    cores, switches = got[spin]
    assert cores > 0.2, got  # it spun for the whole second (on cores others share)
    cores, switches = got[wake]
    assert cores < 0.1 and switches > 50, got  # woke ~200 times a second, used little


def test_the_page_compares_each_setup_with_nothing_beside(monkeypatch) -> None:
    monkeypatch.setattr(b, "machine", lambda: {"cpus": "2"})  # not lscpu, not git: no process
    monkeypatch.setattr(b, "git_state", lambda: "`abc1234`")
    blocks = [
        b.Block("N", forward=[0.100, 0.102, 0.098]),
        b.Block("D", 20.0, {"ServeController": (0.04, 400.0), "raylet": (0.01, 100.0)}, [0.12]),
        b.Block("Q", 21.0, {"ServeController": (0.02, 200.0), "raylet": (0.01, 100.0)}, [0.11]),
    ]
    args = argparse.Namespace(blocks="NDQ", settle=8.0, seconds=10.0, forwards=1, gap=1.1)
    text = "\n".join(b.page(args, blocks, b.Path("/m/qwen2_vl-small"), "now"))
    assert "| Ray's timer defaults | 1 | 20.0 | 0.050 | 500 | 120.0 | 1.200x |" in text
    assert "| vitserve as shipped | 1 | 21.0 | 0.030 | 300 | 110.0 | 1.100x |" in text
    assert "| ServeController | 0.0400 | 400 | 0.0200 | 200 |" in text
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1" in text  # D's values, stated
    assert "the idle cluster's CPU 0.050 -> 0.030 cores (-40%)" in text
    assert "1.200x (Ray's timers) and 1.100x (vitserve's)" in text
