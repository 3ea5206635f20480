"""The report of a scenario: each point's figures from its per-request records
(:mod:`loadtest.harness.measures`) and the service's /metrics (deltas over each point), the
Markdown tables, ``stats.json`` and the PNG plots.

Invariants:

* The first table after the ``Started`` line is the points table (``loadtest/readme_tables.py``
  copies it into the README): one row per point, with its latency percentiles, throughput,
  goodput at both SLOs and its publishing-rule status; a point below the rule says so in its
  row and in the sentence under the table, never only in ``stats.json``.
* Every scenario's report has the latency-percentile, goodput and latency-distribution plots;
  the others (throughput vs concurrency, hit rate, replicas, in flight) when their data exist.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.harness import measures, promtext
from loadtest.harness.load import PUBLISH_MIN_REQUESTS, PUBLISH_MIN_S
from loadtest.harness.measures import Record

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
    records: Sequence[Record],
    metrics_before: str,
    metrics_after: str,
    *,
    load: str,
    slos_ms: Sequence[float],
    metric: str = "e2el",
    users: int | None = None,
    rate: float | None = None,
    start: float | None = None,
    cpu: dict[str, float | None] | None = None,
    locust_csv: str | None = None,
) -> dict[str, Any]:
    """One point's figures: from its records (:func:`measures.summarize`), the service's
    /metrics deltas, the CPU shares; ``locust_csv``: locust's own count, cross-checked."""
    s = measures.summarize(records, slos_ms, metric=metric, start=start)
    s.update(load=load, users=users, rate=rate)
    values = [v * 1000 for r in records if r.ok and (v := r.metric(metric)) is not None]
    s["quantiles_ms"] = [measures.percentile(values, q) for q in range(101)] if values else []
    s["metrics"] = metrics_summary(metrics_before, metrics_after)
    s["cpu"] = cpu or {}
    if locust_csv:
        s["locust_requests"] = parse_locust_stats(locust_csv)["requests"]
    return s


def _per(a: float, b: float) -> float:
    return a / b if b else math.nan


def _f(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _ms(x: float | None) -> str:
    """A latency in ms: whole ms from 10 ms up, one decimal below."""
    return _f(x, 1 if x is not None and x < 10 else 0)


def _slo(metric: str, slo_ms: float) -> str:
    return f"{metric} <= {slo_ms / 1000:g} s" if slo_ms >= 1000 else f"{metric} <= {slo_ms:g} ms"


def _goodput_cell(g: dict[str, Any]) -> str:
    share = g["share"]
    pct = "-" if math.isnan(share) else f"{100 * share:.0f}%"
    return f"{_f(g['rps'], 2)} ({pct})"


def rule_cell(rule: dict[str, Any]) -> str:
    return "met" if rule["met"] else "**below**: " + "; ".join(rule["reasons"])


def markdown(stats: dict[str, Any]) -> str:
    runs = stats["runs"]
    metric = stats.get("slo_metric", "e2el")
    slos = stats.get("slos_ms") or [g["slo_ms"] for g in (runs[0]["goodput"] if runs else [])]
    rule = stats.get("rule") or {"min_s": PUBLISH_MIN_S, "min_requests": PUBLISH_MIN_REQUESTS}
    heads = " | ".join(f"goodput req/s (share), {_slo(metric, s)}" for s in slos)
    out = [
        f"# {stats['scenario']}: {stats.get('description', '')}",
        "",
        f"Started {stats.get('started', '?')}; server {stats.get('server', {})}; "
        f"load: {stats.get('generator', 'locust')}; run length: "
        f"{stats.get('run_mode', '?')}.",
        "",
        "| load | requests | failures | seconds | req/s | images/s | p50 ms | p90 ms | p99 ms "
        f"| {heads} | publishing rule | hit rate | images encoded | forwards | images/forward |",
        "|---" * (14 + len(slos)) + "|",
    ]
    for r in runs:
        m = r["metrics"]
        good = " | ".join(_goodput_cell(g) for g in r["goodput"])
        out.append(
            f"| {r['load']} | {r['requests']} | {r['failures']} | {_f(r['duration_s'])} "
            f"| {_f(r['rps'], 2)} | {_f(r['images_per_s'], 2)} | {_ms(r['p50_ms'])} "
            f"| {_ms(r['p90_ms'])} | {_ms(r['p99_ms'])} | {good} | {rule_cell(r['rule'])} "
            f"| {_f(m['hit_rate'], 2)} | {_f(m['images_encoded'])} | {_f(m['forwards'])} "
            f"| {_f(_per(m['images_encoded'], m['forwards']), 2)} |"
        )
    below = [r["load"] for r in runs if not r["rule"]["met"]]
    out += [
        "",
        f"Publishing rule: a published point has at least {rule['min_s']:g} s and "
        f"{rule['min_requests']:,} requests. "
        + (
            f"**{len(below)} of {len(runs)} points are below it** ({', '.join(below)}): "
            "their figures are a development run's, not for capacity planning."
            if below
            else "Every point meets it."
        ),
        "",
        "req/s counts the requests that succeeded; goodput (as vLLM's `--goodput`) the "
        f"requests/s that succeeded with {metric} "
        + ("(end-to-end latency)" if metric == "e2el" else "(time to first token)")
        + " within the SLO, and in brackets their share of all the point's requests (a "
        "failed request is never within it). Latency percentiles are of the successful "
        "requests, from each request's own record.",
    ]
    if any("ttft_p50_ms" in r for r in runs):
        out += [
            "",
            "Time to first token (ms; the chat's streamed answers):",
            "",
            "| load | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 |",
            "|---|---|---|---|---|---|",
        ]
        for r in runs:
            out.append(
                f"| {r['load']} | {_ms(r.get('ttft_p50_ms'))} | {_ms(r.get('ttft_p90_ms'))} "
                f"| {_ms(r.get('ttft_p99_ms'))} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} |"
            )
    if any(r.get("open_loop") for r in runs):
        out += [
            "",
            "Open loop: arrivals, what the in-flight bound turned away, and how late the "
            "generator sent (latency counts from the scheduled arrival):",
            "",
            "| load | arrivals | overflow (failures) | most in flight (bound) "
            "| send lag p99 ms | send lag max ms |",
            "|---|---|---|---|---|---|",
        ]
        for r in runs:
            o = r.get("open_loop") or {}
            out.append(
                f"| {r['load']} | {r['requests']} | {r['overflow']} "
                f"| {o.get('max_in_flight_seen', '-')} ({o.get('max_in_flight', '-')}) "
                f"| {_ms(r.get('lag_p99_ms'))} | {_ms(r.get('lag_max_ms'))} |"
            )
    out += [
        "",
        "Latency by images per request (ms):",
        "",
        "| load | images/request | requests | failures | p50 | p90 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        for k, e in r["by_k"].items():
            out.append(
                f"| {r['load']} | {k} | {e['requests']} | {e['failures']} | {_ms(e['p50_ms'])} "
                f"| {_ms(e['p90_ms'])} | {_ms(e['p99_ms'])} |"
            )
    out += [
        "",
        "Tower forwards per bucket and images per forward (from /metrics):",
        "",
        "| load | forwards per bucket | images per forward (<= bound: forwards) |",
        "|---|---|---|",
    ]
    for r in runs:
        m = r["metrics"]
        fb = ", ".join(f"{b}: {_f(v)}" for b, v in m["forwards_by_bucket"].items()) or "-"
        hb = ", ".join(f"<={_f(le)}: {_f(n)}" for le, n in m["batch_images_hist"]) or "-"
        out.append(f"| {r['load']} | {fb} | {hb} |")
    if any(r.get("cpu") for r in runs):
        out += [
            "",
            "CPU (seconds of CPU per second of run; 2.0 = both cores):",
            "",
            "| load | load generator | service (Ray processes) |",
            "|---|---|---|",
        ]
        for r in runs:
            c = r.get("cpu") or {}
            out.append(f"| {r['load']} | {_f(c.get('generator'), 2)} | {_f(c.get('service'), 2)} |")
    failed = [r for r in runs if r.get("errors")]
    if failed:
        out += ["", "Failures, most frequent first:", ""]
        for r in failed:
            for err, n in r["errors"].items():
                out.append(f"- {r['load']}: {n} x `{err.replace('`', chr(39))}`")
    for r in runs:
        # locust writes its CSV before the requests in flight at the stop have ended (they end
        # within --stop-timeout and are recorded): fewer records than locust counted means a
        # request was lost
        n = r.get("locust_requests")
        if n is not None and n > r["requests"]:
            out += [
                "",
                f"{r['load']}: locust counted {n} requests, the records only {r['requests']}.",
            ]
    if stats.get("chat"):
        c = stats["chat"]
        out += ["", f"Chat server: {c.get('url')} (model {c.get('model') or 'not named'})."]
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


def _labels(runs: list[dict[str, Any]]) -> list[str]:
    """Each point's load, and under it whether it is below the publishing rule."""
    return [str(r["load"]) + ("" if r["rule"]["met"] else "\n(below rule)") for r in runs]


def plots(stats: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    runs = stats["runs"]
    metric = stats.get("slo_metric", "e2el")
    slos = stats.get("slos_ms") or []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        made.append(name)

    xs = list(range(len(runs)))
    # Latency percentiles of the SLO metric per point, with the SLOs.
    prefix = "" if metric == "e2el" else "ttft_"
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.25
    for j, q in enumerate(("p50", "p90", "p99")):
        values = [r.get(f"{prefix}{q}_ms", math.nan) for r in runs]
        ax.bar([x + (j - 1) * width for x in xs], values, width, label=q)
    for slo, style in zip(slos, ("--", ":"), strict=False):
        ax.axhline(slo, color="k", linestyle=style, linewidth=1, label=f"SLO {slo:g} ms")
    ax.set_xticks(xs, _labels(runs), fontsize=8)
    ax.set(ylabel=f"{metric} (ms)", title=f"{stats['scenario']}: {metric} percentiles")
    ax.legend(fontsize=7)
    save(fig, "latency_percentiles.png")

    # Throughput and goodput at each SLO per point.
    fig, ax = plt.subplots(figsize=(6, 4))
    n = 1 + len(slos)
    width = 0.8 / n
    ax.bar([x - 0.4 + width / 2 for x in xs], [r["rps"] for r in runs], width, label="req/s")
    for j, slo in enumerate(slos):
        values = [r["goodput"][j]["rps"] for r in runs]
        ax.bar(
            [x - 0.4 + width * (j + 1.5) for x in xs],
            values,
            width,
            label=f"goodput, {_slo(metric, slo)}",
        )
    ax.set_xticks(xs, _labels(runs), fontsize=8)
    ax.set(ylabel="requests/s", title=f"{stats['scenario']}: throughput and goodput")
    ax.legend(fontsize=7)
    save(fig, "goodput.png")

    # Distribution of the SLO metric per point, with the SLOs.
    if any(r.get("quantiles_ms") for r in runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            qs = r.get("quantiles_ms") or []
            if qs:
                ax.plot(qs, [q / 100 for q in range(len(qs))], label=str(r["load"]))
        for slo, style in zip(slos, ("--", ":"), strict=False):
            ax.axvline(slo, color="k", linestyle=style, linewidth=1)
        ax.set(
            xlabel=f"{metric} (ms)",
            ylabel="share of successful requests",
            title=f"{stats['scenario']}: {metric} distribution (SLOs dashed)",
        )
        ax.legend(fontsize=7)
        save(fig, "latency_cdf.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ks = list(r["by_k"])
        ax.plot(ks, [r["by_k"][k]["p50_ms"] for k in ks], "o-", label=f"{r['load']} p50")
        ax.plot(ks, [r["by_k"][k]["p90_ms"] for k in ks], "x--", label=f"{r['load']} p90")
    ax.set(xlabel="images per request", ylabel="latency (ms)", title=stats["scenario"])
    ax.legend(fontsize=7)
    save(fig, "latency_vs_images.png")

    numeric = [r for r in runs if isinstance(r.get("users"), int) and not r.get("rate")]
    if len(numeric) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        us = [r["users"] for r in numeric]
        ax.plot(us, [r["rps"] for r in numeric], "o-", label="requests/s")
        ax.plot(us, [r["images_per_s"] for r in numeric], "s-", label="images/s")
        for j, slo in enumerate(slos):
            ax.plot(
                us,
                [r["goodput"][j]["rps"] for r in numeric],
                "^--",
                label=f"goodput, {_slo(metric, slo)}",
            )
        ax.set(xlabel="concurrent users", ylabel="throughput", title=stats["scenario"])
        ax.legend(fontsize=7)
        save(fig, "throughput_vs_concurrency.png")

    opened = [r for r in runs if (r.get("open_loop") or {}).get("in_flight")]
    if opened:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in opened:
            series = r["open_loop"]["in_flight"]
            ax.step([t for t, _ in series], [c for _, c in series], where="post", label=r["load"])
        bound = opened[0]["open_loop"].get("max_in_flight")
        if bound:
            ax.axhline(bound, color="r", linestyle="--", linewidth=1, label="bound")
        ax.set(xlabel="seconds", ylabel="requests in flight", title=stats["scenario"])
        ax.legend(fontsize=7)
        save(fig, "in_flight_over_time.png")

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
        save(fig, "hit_rate_over_time.png")

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
        save(fig, "replicas_over_time.png")
    return made


def write(stats: dict[str, Any], out_dir: Path) -> str:
    stats["plots"] = plots(stats, out_dir)
    text = markdown(stats)
    (out_dir / "report.md").write_text(text)
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=1, default=str))
    return text
