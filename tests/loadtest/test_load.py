"""Run lengths, the Poisson arrival schedule (its statistics, with seeded RNGs) and the users of
a staged closed-loop load."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.harness.load import (
    PUBLISH_MIN_REQUESTS,
    PUBLISH_MIN_S,
    RunLength,
    closed_loop_tick,
    poisson_arrivals,
    users_at,
)


def gaps(schedule: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *schedule], schedule, strict=False)]


def test_poisson_gaps_are_exponential_at_the_rate() -> None:
    rate, n = 4.0, 20_000
    schedule = poisson_arrivals(rate, random.Random(7), RunLength(0, n, math.inf))
    assert len(schedule) == n
    assert schedule == sorted(schedule)
    g = sorted(gaps(schedule))
    mean = sum(g) / n
    assert abs(mean - 1 / rate) < 3 * (1 / rate) / math.sqrt(n)  # within 3 standard errors
    sd = math.sqrt(sum((x - mean) ** 2 for x in g) / (n - 1))
    assert 0.97 < sd / mean < 1.03  # an exponential's coefficient of variation is 1
    # Kolmogorov-Smirnov against Exp(rate), at the 1% level
    ks = max(
        max(abs((i + 1) / n - (1 - math.exp(-rate * x))), abs(i / n - (1 - math.exp(-rate * x))))
        for i, x in enumerate(g)
    )
    assert ks < 1.63 / math.sqrt(n)


def test_poisson_counts_per_second_have_poisson_dispersion() -> None:
    rate, seconds = 3.0, 4000
    schedule = poisson_arrivals(rate, random.Random(11), RunLength.fixed(seconds))
    counts = [0] * seconds
    for t in schedule:
        counts[int(t)] += 1
    mean = sum(counts) / seconds
    var = sum((c - mean) ** 2 for c in counts) / (seconds - 1)
    assert abs(mean - rate) < 3 * math.sqrt(rate / seconds)
    assert 0.9 < var / mean < 1.1  # index of dispersion 1: no bursts, no pacing


def test_seeded_schedules_repeat_and_differ() -> None:
    length = RunLength.fixed(100)
    a = poisson_arrivals(0.5, random.Random(3), length)
    assert a == poisson_arrivals(0.5, random.Random(3), length)
    assert a != poisson_arrivals(0.5, random.Random(4), length)


def test_the_publishing_length_has_both_the_seconds_and_the_requests() -> None:
    rule = RunLength.publishing(max_s=10_000)
    assert (rule.min_s, rule.min_requests) == (PUBLISH_MIN_S, PUBLISH_MIN_REQUESTS) == (60, 1000)
    slow = poisson_arrivals(2.0, random.Random(1), rule)  # 60 s hold ~120: the count decides
    assert len(slow) == 1000 and slow[-1] > 60
    fast = poisson_arrivals(50.0, random.Random(1), rule)  # 1000 by ~20 s: the time decides
    assert len(fast) > 2500 and 60 <= fast[-1] < 60.5 and fast[-2] < 60


def test_the_cap_cuts_a_schedule_short_of_its_requests() -> None:
    schedule = poisson_arrivals(1.0, random.Random(2), RunLength.publishing(max_s=100))
    assert all(t < 100 for t in schedule)
    assert 60 < len(schedule) < 1000  # the report then marks the point below the rule


def test_fixed_length_has_no_request_floor() -> None:
    schedule = poisson_arrivals(0.3, random.Random(5), RunLength.fixed(20))
    assert all(t < 20 for t in schedule) and len(schedule) < 20


@pytest.mark.parametrize("rate", [0, -1, math.inf, math.nan])
def test_bad_rates_are_refused(rate: float) -> None:
    with pytest.raises(ValueError):
        poisson_arrivals(rate, random.Random(0), RunLength.fixed(10))


def test_run_length_is_done_at_the_first_moment_both_hold() -> None:
    rule = RunLength(60, 1000, 3600)
    assert not rule.done(59.9, 5000)
    assert not rule.done(600, 999)
    assert rule.done(60, 1000)
    assert rule.done(3600, 10)  # the cap
    assert RunLength.fixed(20).done(20, 0) and not RunLength.fixed(20).done(19.9, 10**6)
    assert RunLength(60, 1000, 3600).at_least(80) == RunLength(80, 1000, 3600)
    with pytest.raises(ValueError):
        RunLength(10, 0, 5)


def test_users_follow_the_stages_and_hold_the_last() -> None:
    stages = [(15.0, 1), (60.0, 4), (80.0, 1)]
    assert [users_at(stages, t) for t in (0, 14.9, 15, 59, 60, 79, 500)] == [1, 1, 4, 4, 1, 1, 1]
    with pytest.raises(ValueError):
        users_at([(10.0, 1), (5.0, 2)], 0)


def test_the_shape_holds_its_load_until_the_point_is_done() -> None:
    stages = [(15.0, 1), (60.0, 4), (80.0, 1)]
    length = RunLength(60, 1000, 3600).at_least(80)
    assert closed_loop_tick(stages, length, 30, 10) == (4, 4.0)
    assert closed_loop_tick(stages, length, 90, 500) == (1, 1.0)  # past the stages, short
    assert closed_loop_tick(stages, length, 90, 1000) is None
    assert closed_loop_tick([(1e9, 2)], RunLength.fixed(20), 20, 0) is None
    # the length counts from the first request's start once there is one
    assert closed_loop_tick([(1e9, 2)], RunLength.fixed(20), 20.5, 3, window_s=19.5) == (2, 2.0)
