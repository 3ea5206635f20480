"""A point's figures from its records: percentiles, vLLM's goodput and the publishing rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from loadtest.harness.measures import (
    OVERFLOW,
    Record,
    goodput,
    percentile,
    read_records,
    rule_status,
    summarize,
)


def rec(start: float, latency: float | None, ok: bool = True, k: int = 1, **kw) -> Record:
    return Record(start=start, latency_s=latency, ok=ok, k=k, **kw)


def test_percentiles_match_numpys_linear_method() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 1001):
        xs = [rng.lognormvariate(0, 1) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_goodput_counts_successes_within_the_slo_over_the_duration() -> None:
    records = [
        rec(0, 0.5),
        rec(1, 1.0),  # exactly at the SLO: good (vLLM's slo >= value)
        rec(2, 1.5),
        rec(3, 0.2, ok=False, error="HTTP 500"),  # fast but failed: never good
        rec(4, None, ok=False, error=OVERFLOW),
    ]
    g = goodput(records, 1000, duration_s=10)
    assert (g["good"], g["rps"], g["share"]) == (2, 0.2, 2 / 5)
    loose = goodput(records, 2000, duration_s=10)
    assert loose["good"] == 3 and loose["rps"] >= g["rps"]
    with pytest.raises(ValueError):
        goodput(records, 0, duration_s=10)


def test_goodput_of_ttft_reads_the_first_token() -> None:
    records = [rec(0, 5.0, ttft_s=0.4), rec(1, 0.5, ttft_s=None), rec(2, 3.0, ttft_s=1.2)]
    g = goodput(records, 1000, duration_s=4, metric="ttft")
    assert g["good"] == 1  # a request without a TTFT has not met a TTFT SLO
    with pytest.raises(ValueError):
        goodput(records, 1000, duration_s=4, metric="tpot")


def test_the_publishing_rule_needs_both() -> None:
    assert rule_status(60, 1000)["met"]
    assert rule_status(59.4, 5000)["reasons"] == ["59 s < 60 s"]
    assert rule_status(600, 999)["reasons"] == ["999 < 1000 requests"]
    both = rule_status(20, 12)
    assert not both["met"] and len(both["reasons"]) == 2


def test_summary_of_a_point() -> None:
    rng = random.Random(1)
    records = [rec(i * 0.05, rng.uniform(0.1, 3.0), k=1 + i % 4) for i in range(1200)]
    records.append(rec(70.0, 0.5, ok=False, k=2, error="HTTP 503: busy"))
    s = summarize(records, [1000, 2500])
    assert s["requests"] == 1201 and s["failures"] == 1 and s["succeeded"] == 1200
    assert s["duration_s"] == pytest.approx(70.5)  # first start to last end
    assert s["rps"] == pytest.approx(1200 / 70.5)
    assert s["images_sent"] == sum(r.k for r in records)
    ok_ms = [r.latency_s * 1000 for r in records if r.ok]
    assert s["p99_ms"] == pytest.approx(float(np.percentile(ok_ms, 99)))
    tight, loose = s["goodput"]
    assert 0 < tight["rps"] < loose["rps"] <= s["rps"]
    assert s["rule"]["met"]
    assert s["by_k"][2]["failures"] == 1
    assert s["errors"] == {"HTTP 503: busy": 1}
    short = summarize(records[:50], [1000, 2500])
    assert not short["rule"]["met"]


def test_open_loop_window_starts_at_the_schedule() -> None:
    records = [rec(105.0, 1.0, lag_s=0.002), rec(110.0, 2.0, lag_s=0.010)]
    s = summarize(records, [1000], start=100.0)
    assert s["duration_s"] == 12.0
    assert s["lag_max_ms"] == pytest.approx(10.0)


def test_records_round_trip_as_json_lines() -> None:
    records = [rec(1.5, 0.25, k=3, name="x k=3", ttft_s=0.1), rec(2, None, False, error=OVERFLOW)]
    text = "".join(r.to_json() + "\n" for r in records)
    assert read_records(text) == records


def test_an_empty_point_summarizes_without_error() -> None:
    s = summarize([], [1000, 5000])
    assert s["requests"] == 0 and math.isnan(s["p50_ms"]) and not s["rule"]["met"]
