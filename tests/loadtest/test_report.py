"""The report builder from canned records, a canned locust CSV and canned /metrics pages (no
server)."""

from __future__ import annotations

import math
from pathlib import Path

from loadtest.harness import promtext, report
from loadtest.harness.measures import OVERFLOW, Record

STATS_CSV = """\
Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,\
Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,\
90%,95%,98%,99%,99.9%,99.99%,100%
POST,/v1/encode k=1,10,0,120,130.5,90,300,500,0.5,0.0,120,130,140,150,200,250,280,300,300,300,300
POST,/v1/encode k=3,5,1,400,420.0,300,900,1500,0.25,0.05,400,410,450,500,800,900,900,900,900,900,900
,Aggregated,15,1,200,227.0,90,900,833,0.75,0.05,200,300,400,400,600,800,900,900,900,900,900
"""

LABELS = 'application="vitserve",deployment="{d}",replica="{r}"'


def page(
    hits: float, misses: float, fwd_448: float, fwd_224: float, b1: float, b2: float, encoded: float
) -> str:
    enc = LABELS.format(d="EncoderDeployment", r="enc#1")
    ing = LABELS.format(d="Ingress", r="ing#1")
    return (
        "\n".join(
            [
                "# HELP vitserve_cache_hits_total Store lookups that found the embedding",
                "# TYPE vitserve_cache_hits_total counter",
                f"vitserve_cache_hits_total{{{ing}}} {hits}",
                f"vitserve_cache_misses_total{{{ing}}} {misses}",
                f"vitserve_images_encoded_total{{{enc}}} {encoded}",
                f'vitserve_tower_forward_calls_total{{{enc},bucket="448x448"}} {fwd_448}',
                f'vitserve_tower_forward_calls_total{{{enc},bucket="224x224"}} {fwd_224}',
                f'vitserve_batch_images_bucket{{{enc},le="1.0"}} {b1}',
                f'vitserve_batch_images_bucket{{{enc},le="2.0"}} {b1 + b2}',
                f'vitserve_batch_images_bucket{{{enc},le="+Inf"}} {b1 + b2}',
                f"vitserve_batch_images_count{{{enc}}} {b1 + b2}",
                f"vitserve_batch_images_sum{{{enc}}} {b1 + 2 * b2}",
            ]
        )
        + "\n"
    )


BEFORE = page(hits=5, misses=5, fwd_448=2, fwd_224=1, b1=3, b2=0, encoded=3)
AFTER = page(hits=11, misses=23, fwd_448=10, fwd_224=5, b1=7, b2=8, encoded=26)


def test_locust_csv_figures() -> None:
    s = report.parse_locust_stats(STATS_CSV)
    assert (s["requests"], s["failures"]) == (15, 1)
    assert (s["p50_ms"], s["p90_ms"], s["p99_ms"]) == (200, 600, 900)
    assert s["rps"] == 0.75
    assert s["images_sent"] == 10 * 1 + 5 * 3
    assert s["by_k"][3] == {
        "requests": 5,
        "failures": 1,
        "p50_ms": 400,
        "p90_ms": 800,
        "p99_ms": 900,
        "mean_ms": 420.0,
    }


def test_metrics_deltas() -> None:
    m = report.metrics_summary(BEFORE, AFTER)
    assert (m["cache_hits"], m["cache_misses"]) == (6, 18)
    assert m["hit_rate"] == 0.25
    assert m["images_encoded"] == 23
    assert m["forwards_by_bucket"] == {"224x224": 4, "448x448": 8}
    assert m["forwards"] == 12
    assert m["batch_images_hist"] == [(1.0, 4), (2.0, 8)]
    assert "batch_images_mean" not in m  # Ray's _sum is not the observed sum


def records(n: int, *, spacing_s: float, latency_s: float, k: int = 2) -> list[Record]:
    """``n`` requests ``spacing_s`` apart, every tenth one 4x slower, the 7th failed."""
    return [
        Record(
            start=1000 + i * spacing_s,
            latency_s=latency_s * (4 if i % 10 == 9 else 1),
            ok=i != 6,
            k=k,
            name=f"/v1/encode k={k}",
            error=None if i != 6 else "HTTP 503: busy",
        )
        for i in range(n)
    ]


def test_markdown_points_table_marks_the_rule_and_goodput() -> None:
    short = report.run_summary(
        records(20, spacing_s=1.0, latency_s=0.5),
        BEFORE,
        AFTER,
        load="4 users",
        users=4,
        slos_ms=[1000, 5000],
        cpu={"generator": 0.1, "service": 1.5},
        locust_csv=STATS_CSV,
    )
    long = report.run_summary(
        records(1200, spacing_s=0.06, latency_s=0.5),
        BEFORE,
        AFTER,
        load="8 users",
        users=8,
        slos_ms=[1000, 5000],
    )
    stats = {
        "scenario": "random",
        "runs": [short, long],
        "machine": {"cpus": "2"},
        "slo_metric": "e2el",
        "slos_ms": [1000, 5000],
    }
    text = report.markdown(stats)
    head = next(line for line in text.splitlines() if line.startswith("| load |"))
    assert "goodput req/s (share), e2el <= 1 s" in head and "e2el <= 5 s" in head
    assert "publishing rule" in head
    rule = text.splitlines()[text.splitlines().index(head) + 1]
    assert rule.count("|---") == head.count("|") - 1  # as many delimiters as header cells
    # 20 requests from 1000 s to 1021 s (the last one slow): 19 succeeded, 17 within 1 s (two
    # slow), all 19 within 5 s; p90 of 17 x 500 ms and 2 x 2000 ms interpolates to 800 ms
    assert (
        "| 4 users | 20 | 1 | 21 | 0.90 | 1.90 | 500 | 800 | 2000 | 0.81 (85%) | 0.90 (95%) "
        "| **below**: 21 s < 60 s; 20 < 1000 requests | 0.25 | 23 | 12 | 1.92 |" in text
    )
    row = next(line for line in text.splitlines() if line.startswith("| 8 users |"))
    assert "| met |" in row
    assert "**1 of 2 points are below it** (4 users)" in text
    assert "| 4 users | 2 | 20 | 1 | 500 | 800 | 2000 |" in text  # by images per request
    assert "224x224: 4, 448x448: 8" in text
    assert "<=1: 4, <=2: 8" in text
    assert "| 4 users | 0.10 | 1.50 |" in text
    assert "- 4 users: 1 x `HTTP 503: busy`" in text
    assert "locust counted" not in text  # it counted fewer (the CSV is written at the stop)
    lost = report.markdown({**stats, "runs": [{**short, "locust_requests": 25}]})
    assert "4 users: locust counted 25 requests, the records only 20." in lost
    assert "- cpus: 2" in text


def test_every_point_meeting_the_rule_says_so() -> None:
    run = report.run_summary(
        records(1000, spacing_s=0.07, latency_s=0.2), "", "", load="1 users", slos_ms=[300, 900]
    )
    text = report.markdown({"scenario": "agent", "runs": [run], "slos_ms": [300, 900]})
    assert "Every point meets it." in text and "below" not in text


def test_chat_and_open_loop_tables() -> None:
    chat = [
        Record(start=i, latency_s=2.0, ok=True, k=1 + i % 3, ttft_s=0.5 + i / 100, name="c")
        for i in range(30)
    ]
    run = report.run_summary(chat, "", "", load="2 users", slos_ms=[600, 2000], metric="ttft")
    assert run["goodput"][0]["good"] == 11  # TTFT 0.50 .. 0.60 s
    text = report.markdown(
        {"scenario": "chat", "runs": [run], "slo_metric": "ttft", "slos_ms": [600, 2000]}
    )
    assert "ttft <= 600 ms" in text and "(time to first token)" in text
    assert "| 2 users | 645 | 761 | 787 | 2000 | 2000 |" in text  # TTFT 500 .. 790 ms

    arrivals = records(10, spacing_s=1.0, latency_s=0.5)
    arrivals.append(Record(start=1011, latency_s=None, ok=False, k=2, error=OVERFLOW))
    opened = report.run_summary(arrivals, "", "", load="0.5 req/s", rate=0.5, slos_ms=[1000, 5000])
    opened["open_loop"] = {"max_in_flight": 4, "max_in_flight_seen": 4, "in_flight": [[0, 1]]}
    text = report.markdown({"scenario": "open", "runs": [opened], "slos_ms": [1000, 5000]})
    assert "| 0.5 req/s | 11 | 1 | 4 (4) | - | - |" in text


def test_plots_are_written(tmp_path: Path) -> None:
    run = report.run_summary(
        records(50, spacing_s=0.5, latency_s=0.3),
        BEFORE,
        AFTER,
        load="1 users",
        users=1,
        slos_ms=[500, 2000],
    )
    run2 = {**run, "load": "2 users", "users": 2}
    stats = {"scenario": "random", "runs": [run, run2], "slos_ms": [500, 2000]}
    made = report.plots(stats, tmp_path)
    assert {
        "latency_percentiles.png",
        "goodput.png",
        "latency_cdf.png",
        "latency_vs_images.png",
        "throughput_vs_concurrency.png",
    } <= set(made)
    for name in made:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hit_rate_series_and_empty_metrics() -> None:
    tl = [
        {"t": 0, "hits": 0, "misses": 0},
        {"t": 2, "hits": 1, "misses": 3},
        {"t": 4, "hits": 1, "misses": 3},
        {"t": 6, "hits": 3, "misses": 3},
    ]
    assert report.hit_rate_series(tl) == [(2, 0.25), (6, 1.0)]
    assert math.isnan(report.metrics_summary("", "")["hit_rate"])
    assert promtext.replicas(promtext.parse(AFTER), "EncoderDeployment") == 1
