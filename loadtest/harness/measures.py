"""A load point's figures from its per-request records: latency percentiles, throughput, goodput
under latency SLOs, and whether the point meets the publishing rule (pure: no clock, no I/O).

Every generator of the harness (locust's closed-loop users, the open-loop generator) writes one
:class:`Record` per request, as a JSON line; the report reads the figures from them, never from
a generator's own rounded summary.

Goodput is vLLM's (``vllm bench serve --goodput``, ``vllm/benchmarks/serve.py``): a request is
*good* when it succeeded and its SLO metric is at most the SLO (``e2el``: its end-to-end
latency; ``ttft``: its time to the first token); goodput is the good requests per second of the
point's duration (``request_goodput = good_completed / dur_s``), beside the throughput of all
successful requests (``request_throughput = completed / dur_s``). The *share* within the SLO is
good requests over all of the point's requests: a failed or overflowed request is never good.

The *duration* of a point is its window: from its start (the open-loop schedule's start; in
closed loop, the first request's start) to the end of its last request, as vLLM's benchmark
duration runs from its start until every request is done.

Invariants:

* Each record counts once in ``requests``; a failed one (an HTTP error, a timeout, an overflow
  of the open-loop generator's in-flight bound) counts in ``failures`` and never in a latency
  percentile, the throughput or the goodput.
* ``0 <= goodput <= throughput`` and ``0 <= share <= 1``; a tighter SLO never gives more goodput.
* Percentiles interpolate linearly between order statistics (numpy's default, what vLLM
  reports); an empty sample gives NaN, never an error.
* :func:`rule_status` says a point is published only when its duration is at least the rule's
  seconds *and* it has at least the rule's requests; otherwise its reasons name each shortfall.
* :func:`summarize` is a pure function of its arguments, and its result is plain JSON types.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtest.harness.load import PUBLISH_MIN_REQUESTS, PUBLISH_MIN_S

__all__ = [
    "METRICS",
    "OVERFLOW",
    "Record",
    "goodput",
    "percentile",
    "read_records",
    "rule_status",
    "summarize",
    "window",
]

METRICS = ("e2el", "ttft")  # what an SLO bounds: end-to-end latency, time to first token
OVERFLOW = "overflow"  # the error of an arrival the open-loop generator could not send


@dataclass(frozen=True)
class Record:
    """One request: when it started (epoch seconds; open loop: its scheduled arrival), its
    end-to-end latency (``None`` when it never ran: an overflow), whether it succeeded, how many
    images it carried, its name, its time to first token (chat) and its error."""

    start: float
    latency_s: float | None
    ok: bool
    k: int
    name: str = ""
    ttft_s: float | None = None
    error: str | None = None
    lag_s: float | None = None  # open loop: how late after its scheduled arrival it was sent

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps({k: v for k, v in data.items() if v is not None or k == "latency_s"})

    @classmethod
    def from_json(cls, line: str) -> Record:
        return cls(**json.loads(line))

    @property
    def end(self) -> float:
        return self.start + (self.latency_s or 0.0)

    def metric(self, name: str) -> float | None:
        if name not in METRICS:
            raise ValueError(f"unknown SLO metric {name!r}: one of {METRICS}")
        return self.latency_s if name == "e2el" else self.ttft_s


def read_records(text: str) -> list[Record]:
    return [Record.from_json(line) for line in text.splitlines() if line.strip()]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics."""
    if not 0 <= q <= 100:
        raise ValueError(f"q is in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def window(records: Sequence[Record], start: float | None = None) -> tuple[float, float]:
    """The point's ``(start, end)``: from ``start`` (default: the first request's) to the end
    of its last request."""
    if not records:
        return (start or 0.0, start or 0.0)
    first = min(r.start for r in records) if start is None else start
    return first, max(max(r.end for r in records), first)


def goodput(
    records: Sequence[Record], slo_ms: float, duration_s: float, metric: str = "e2el"
) -> dict[str, Any]:
    """vLLM's goodput of ``records`` under ``metric <= slo_ms``: good requests, goodput
    (requests/s) and their share of all requests."""
    if not slo_ms > 0:
        raise ValueError(f"an SLO is a positive number of ms, got {slo_ms}")
    good = 0
    for r in records:
        value = r.metric(metric)
        if r.ok and value is not None and value * 1000 <= slo_ms:
            good += 1
    return {
        "metric": metric,
        "slo_ms": slo_ms,
        "good": good,
        "rps": good / duration_s if duration_s > 0 else math.nan,
        "share": good / len(records) if records else math.nan,
    }


def rule_status(
    duration_s: float,
    requests: int,
    min_s: float = PUBLISH_MIN_S,
    min_requests: int = PUBLISH_MIN_REQUESTS,
) -> dict[str, Any]:
    """Whether a point may be published: ``{"met": bool, "reasons": [...]}``."""
    reasons = []
    if not duration_s >= min_s:
        reasons.append(f"{duration_s:.0f} s < {min_s:g} s")
    if requests < min_requests:
        reasons.append(f"{requests} < {min_requests} requests")
    return {"met": not reasons, "reasons": reasons, "min_s": min_s, "min_requests": min_requests}


def _latencies(records: Iterable[Record], metric: str) -> list[float]:
    out = []
    for r in records:
        value = r.metric(metric)
        if r.ok and value is not None:
            out.append(value * 1000)
    return out


def _pcts(ms: Sequence[float], prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}p50_ms": percentile(ms, 50),
        f"{prefix}p90_ms": percentile(ms, 90),
        f"{prefix}p99_ms": percentile(ms, 99),
        f"{prefix}mean_ms": sum(ms) / len(ms) if ms else math.nan,
    }


def summarize(
    records: Sequence[Record],
    slos_ms: Sequence[float],
    *,
    metric: str = "e2el",
    start: float | None = None,
    min_s: float = PUBLISH_MIN_S,
    min_requests: int = PUBLISH_MIN_REQUESTS,
) -> dict[str, Any]:
    """The figures of one point (see the module docstring); ``start``: the window's start when
    it is not the first request's (open loop)."""
    t0, t1 = window(records, start)
    duration = t1 - t0
    ok = [r for r in records if r.ok]
    failures = len(records) - len(ok)
    e2el = _latencies(records, "e2el")
    out: dict[str, Any] = {
        "requests": len(records),
        "failures": failures,
        "overflow": sum(1 for r in records if r.error == OVERFLOW),
        "succeeded": len(ok),
        "duration_s": duration,
        "rps": len(ok) / duration if duration > 0 else math.nan,
        "images_sent": sum(r.k for r in records),
        "images_per_s": sum(r.k for r in records) / duration if duration > 0 else math.nan,
        **_pcts(e2el),
        "slo_metric": metric,
        "goodput": [goodput(records, s, duration, metric) for s in slos_ms],
        "rule": rule_status(duration, len(records), min_s, min_requests),
    }
    ttft = _latencies(records, "ttft")
    if ttft:
        out.update(_pcts(ttft, "ttft_"))
    lags = [r.lag_s * 1000 for r in records if r.lag_s is not None]
    if lags:
        out["lag_p99_ms"] = percentile(lags, 99)
        out["lag_max_ms"] = max(lags)
    by_k: dict[int, dict[str, Any]] = {}
    for k in sorted({r.k for r in records}):
        rs = [r for r in records if r.k == k]
        by_k[k] = {
            "requests": len(rs),
            "failures": sum(1 for r in rs if not r.ok),
            **_pcts(_latencies(rs, "e2el")),
        }
    out["by_k"] = by_k
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    out["errors"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5])
    return out
