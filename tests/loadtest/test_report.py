"""The report builder from a canned locust CSV and canned /metrics pages (no server)."""

from __future__ import annotations

import math

from loadtest.harness import promtext, report

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


def test_markdown_table_row() -> None:
    run = report.run_summary(
        STATS_CSV, BEFORE, AFTER, users=4, duration_s=20.0, cpu={"generator": 0.1, "service": 1.5}
    )
    assert run["images_per_s"] == 25 / 20
    text = report.markdown({"scenario": "random", "runs": [run], "machine": {"cpus": "2"}})
    assert "| 4 | 15 | 1 | 0.75 | 1.25 | 200 | 600 | 900 | 0.25 | 23 | 12 | 1.92 |" in text
    assert "| 4 | 3 | 5 | 400 | 800 | 900 |" in text
    assert "224x224: 4, 448x448: 8" in text
    assert "<=1: 4, <=2: 8" in text
    assert "| 4 | 0.10 | 1.50 |" in text
    assert "- cpus: 2" in text


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
