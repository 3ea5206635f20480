"""``metrics.RunningCount``: a count the store keeps, as a counter's increments."""

from __future__ import annotations

from vitserve.deployments.common.metrics import RunningCount


def test_increments_sum_to_the_latest_reading_and_a_reset_starts_again() -> None:
    count = RunningCount()
    steps = [count.step(r) for r in (0, 0, 5, 7, 7, 2, 4)]
    assert steps == [0, 0, 5, 2, 0, 2, 2]  # 7 -> 2: the store restarted, 2 new evictions
    assert sum(steps[:5]) == 7 and all(s >= 0 for s in steps)
