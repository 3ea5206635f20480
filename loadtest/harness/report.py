"""The report of a scenario: figures from locust's CSV and the service's /metrics (deltas over
each run), the Markdown table, ``stats.json`` and the PNG plots."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

from loadtest.harness import promtext

ENCODER = "EncoderDeployment"
_K = re.compile(r"k=(\d+)$")


def _num(s: str) -> float:
    try:
        return float(s)
    except (TypeError, ValueError):
        return math.nan


def parse_locust_stats(text: str) -> dict[str, Any]:
    """locust's ``<prefix>_stats.csv``: the aggregate row and one row per images-per-request
    (names ending in ``k=<n>``)."""
    rows = list(csv.DictReader(io.StringIO(text)))
    agg = next(r for r in rows if r["Name"] == "Aggregated")
    by_k: dict[int, dict[str, float]] = {}
    images = 0
    for r in rows:
        m = _K.search(r["Name"])
        if not m or r["Name"] == "Aggregated":
            continue
        k = int(m.group(1))
        n = int(r["Request Count"])
        images += k * n
        e = by_k.setdefault(k, {"requests": 0, "failures": 0})
        e["requests"] += n
        e["failures"] += int(r["Failure Count"])
        for q in ("50%", "90%", "99%"):
            e[f"p{q[:-1]}_ms"] = _num(r[q])
        e["mean_ms"] = _num(r["Average Response Time"])
    return {
        "requests": int(agg["Request Count"]),
        "failures": int(agg["Failure Count"]),
        "rps": _num(agg["Requests/s"]),
        "p50_ms": _num(agg["50%"]),
        "p90_ms": _num(agg["90%"]),
        "p99_ms": _num(agg["99%"]),
        "mean_ms": _num(agg["Average Response Time"]),
        "images_sent": images,
        "by_k": {k: by_k[k] for k in sorted(by_k)},
    }


def metrics_summary(before: str, after: str) -> dict[str, Any]:
    """What the service did between two /metrics pages."""
    d = promtext.delta(promtext.parse(after), promtext.parse(before))
    hits = promtext.scalar(d, "vitserve_cache_hits_total")
    misses = promtext.scalar(d, "vitserve_cache_misses_total")
    forwards = promtext.total(d, "vitserve_tower_forward_calls_total", by="bucket")
    hist = promtext.histogram_counts(d, "vitserve_batch_images")
    return {
        "cache_hits": hits,
        "cache_misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else math.nan,
        "images_encoded": promtext.scalar(d, "vitserve_images_encoded_total"),
        "single_flight_joins": promtext.scalar(d, "vitserve_single_flight_joins_total"),
        "forwards_by_bucket": {b: v for b, v in sorted(forwards.items()) if v},
        "forwards": sum(forwards.values()),
        # (no mean from the histogram's _sum: Ray exports count x bucket midpoint there)
        "batch_images_hist": [(le, n) for le, n in hist if n],
    }


def run_summary(
    stats_csv: str,
    metrics_before: str,
    metrics_after: str,
    *,
    users: int | str,
    duration_s: float,
    cpu: dict[str, float] | None = None,
) -> dict[str, Any]:
    s = parse_locust_stats(stats_csv)
    s.update(users=users, duration_s=duration_s, images_per_s=s["images_sent"] / duration_s)
    s["metrics"] = metrics_summary(metrics_before, metrics_after)
    s["cpu"] = cpu or {}
    return s


def _per(a: float, b: float) -> float:
    return a / b if b else math.nan


def _f(x: float, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def markdown(stats: dict[str, Any]) -> str:
    runs = stats["runs"]
    out = [
        f"# {stats['scenario']}: {stats.get('description', '')}",
        "",
        f"Started {stats.get('started', '?')}; server {stats.get('server', {})}; "
        f"load: {stats.get('generator', 'locust')}, closed loop (users = concurrency).",
        "",
        "| users | requests | failures | req/s | images/s | p50 ms | p90 ms | p99 ms "
        "| hit rate | images encoded | forwards | images/forward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        m = r["metrics"]
        out.append(
            f"| {r['users']} | {r['requests']} | {r['failures']} | {_f(r['rps'], 2)} "
            f"| {_f(r['images_per_s'], 2)} | {_f(r['p50_ms'])} | {_f(r['p90_ms'])} "
            f"| {_f(r['p99_ms'])} | {_f(m['hit_rate'], 2)} | {_f(m['images_encoded'])} "
            f"| {_f(m['forwards'])} | {_f(_per(m['images_encoded'], m['forwards']), 2)} |"
        )
    out += [
        "",
        "Latency by images per request (ms):",
        "",
        "| users | images/request | requests | p50 | p90 | p99 |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        for k, e in r["by_k"].items():
            out.append(
                f"| {r['users']} | {k} | {e['requests']} | {_f(e['p50_ms'])} "
                f"| {_f(e['p90_ms'])} | {_f(e['p99_ms'])} |"
            )
    out += [
        "",
        "Tower forwards per bucket and images per forward (from /metrics):",
        "",
        "| users | forwards per bucket | images per forward (<= bound: forwards) |",
        "|---|---|---|",
    ]
    for r in runs:
        m = r["metrics"]
        fb = ", ".join(f"{b}: {_f(v)}" for b, v in m["forwards_by_bucket"].items()) or "-"
        hb = ", ".join(f"<={_f(le)}: {_f(n)}" for le, n in m["batch_images_hist"]) or "-"
        out.append(f"| {r['users']} | {fb} | {hb} |")
    if any(r.get("cpu") for r in runs):
        out += [
            "",
            "CPU (seconds of CPU per second of run; 2.0 = both cores):",
            "",
            "| users | load generator | service (Ray processes) |",
            "|---|---|---|",
        ]
        for r in runs:
            c = r.get("cpu") or {}
            out.append(
                f"| {r['users']} | {_f(c.get('generator'), 2)} | {_f(c.get('service'), 2)} |"
            )
    if stats.get("replicas"):
        counts = [p["replicas"].get(ENCODER, 0) for p in stats["replicas"]]
        out += [
            "",
            f"Encoder replicas over the run: min {min(counts)}, max {max(counts)} "
            f"({len(counts)} samples, 1/s).",
        ]
    out += ["", "Machine:", ""] + [f"- {k}: {v}" for k, v in stats.get("machine", {}).items()]
    if stats.get("notes"):
        out += ["", *stats["notes"]]
    plots = stats.get("plots") or []
    if plots:
        out += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in plots)]
    return "\n".join(out) + "\n"


def hit_rate_series(timeline: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(t since start, hit rate over the interval)`` from consecutive /metrics samples."""
    out = []
    for a, b in itertools.pairwise(timeline):
        dh = b["hits"] - a["hits"]
        dm = b["misses"] - a["misses"]
        if dh + dm > 0:
            out.append((b["t"] - timeline[0]["t"], dh / (dh + dm)))
    return out


def plots(stats: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    runs = stats["runs"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ks = list(r["by_k"])
        ax.plot(ks, [r["by_k"][k]["p50_ms"] for k in ks], "o-", label=f"{r['users']} users p50")
        ax.plot(ks, [r["by_k"][k]["p90_ms"] for k in ks], "x--", label=f"{r['users']} users p90")
    ax.set(xlabel="images per request", ylabel="latency (ms)", title=stats["scenario"])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_vs_images.png", dpi=100)
    plt.close(fig)
    made.append("latency_vs_images.png")

    numeric = [r for r in runs if isinstance(r["users"], int)]
    if len(numeric) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        us = [r["users"] for r in numeric]
        ax.plot(us, [r["rps"] for r in numeric], "o-", label="requests/s")
        ax.plot(us, [r["images_per_s"] for r in numeric], "s-", label="images/s")
        ax.set(xlabel="concurrent users", ylabel="throughput", title=stats["scenario"])
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "throughput_vs_concurrency.png", dpi=100)
        plt.close(fig)
        made.append("throughput_vs_concurrency.png")

    series = hit_rate_series(stats.get("timeline", []))
    if series:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([t for t, _ in series], [h for _, h in series], ".-")
        ax.set(
            xlabel="seconds",
            ylabel="cache hit rate (per scrape interval)",
            ylim=(-0.05, 1.05),
            title=stats["scenario"],
        )
        fig.tight_layout()
        fig.savefig(out_dir / "hit_rate_over_time.png", dpi=100)
        plt.close(fig)
        made.append("hit_rate_over_time.png")

    reps = stats.get("replicas") or []
    if reps:
        t0 = reps[0]["t"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.step(
            [p["t"] - t0 for p in reps],
            [p["replicas"].get(ENCODER, 0) for p in reps],
            where="post",
            label="encoder replicas (running)",
        )
        users = stats.get("users_over_time") or []
        if users:
            ax2 = ax.twinx()
            ax2.step(
                [t - t0 for t, _ in users], [u for _, u in users], "r--", where="post", alpha=0.6
            )
            ax2.set_ylabel("locust users", color="r")
        ax.set(xlabel="seconds", ylabel="replicas", title=stats["scenario"])
        fig.tight_layout()
        fig.savefig(out_dir / "replicas_over_time.png", dpi=100)
        plt.close(fig)
        made.append("replicas_over_time.png")
    return made


def write(stats: dict[str, Any], out_dir: Path) -> str:
    stats["plots"] = plots(stats, out_dir)
    text = markdown(stats)
    (out_dir / "report.md").write_text(text)
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=1, default=str))
    return text
