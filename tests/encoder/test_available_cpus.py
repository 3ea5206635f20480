"""The cores a replica sizes its threads by: its affinity capped by the container's CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vitserve.encoder.device import available_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _v2(tmp_path: Path, text: str) -> str:
    (tmp_path / "cpu.max").write_text(text)
    return str(tmp_path)


def _v1(tmp_path: Path, quota: int, period: int) -> str:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return str(tmp_path)


def test_a_cgroup_v2_quota_caps_the_cores_rounded_up(tmp_path) -> None:
    assert available_cpus(_v2(tmp_path, "50000 100000\n")) == 1  # half a core: one thread
    assert available_cpus(_v2(tmp_path, "150000 100000\n")) == min(AFFINITY, 2)


def test_a_cgroup_v1_quota_caps_the_cores(tmp_path) -> None:
    assert available_cpus(_v1(tmp_path, 100000, 100000)) == 1


@pytest.mark.parametrize("case", ["max 100000\n", "garbage", None])
def test_no_quota_leaves_the_affinity(tmp_path, case: str | None) -> None:
    root = _v2(tmp_path, case) if case is not None else str(tmp_path / "absent")
    assert available_cpus(root) == AFFINITY
    assert available_cpus(_v1(tmp_path, -1, 100000)) == AFFINITY
