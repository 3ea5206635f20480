"""Prometheus text pages (the service's ``GET /metrics``) to numbers: samples summed over the
labels a caller does not group by, deltas between two pages, histogram bucket counts."""

from __future__ import annotations

import math
import re
from collections import defaultdict

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """``(name, sorted label pairs) -> value`` of every sample line."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        key = (m.group(1), labels)
        out[key] = out.get(key, 0.0) + value
    return out


def total(samples: Samples, name: str, by: str | None = None, **match: str) -> dict[str, float]:
    """Sum of ``name``'s samples whose labels match ``match``, grouped by the label ``by``
    (``{"": sum}`` without ``by``)."""
    acc: dict[str, float] = defaultdict(float)
    for (n, labels), v in samples.items():
        if n != name:
            continue
        d = dict(labels)
        if any(d.get(k) != want for k, want in match.items()):
            continue
        acc[d.get(by, "") if by else ""] += v
    return dict(acc)


def scalar(samples: Samples, name: str, **match: str) -> float:
    return sum(total(samples, name, **match).values())


def delta(after: Samples, before: Samples) -> Samples:
    """``after - before`` per series (a series new in ``after`` counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_counts(samples: Samples, name: str) -> list[tuple[float, float]]:
    """``[(upper bound, observations in (previous bound, bound]), ...]`` of histogram ``name``
    summed over all its series (from the cumulative ``_bucket`` samples)."""
    cum = total(samples, f"{name}_bucket", by="le")
    bounds = sorted((float(le), v) for le, v in cum.items())
    out, prev = [], 0.0
    for le, v in bounds:
        out.append((le, v - prev))
        prev = v
    return out


def histogram_mean(samples: Samples, name: str) -> float:
    """Mean from ``_sum / _count`` (Ray exports an approximate ``_sum``); nan when empty."""
    count = scalar(samples, f"{name}_count")
    return scalar(samples, f"{name}_sum") / count if count else math.nan


def replicas(samples: Samples, deployment: str) -> int:
    """Distinct ``replica`` tags of ``deployment`` among the series (those that have recorded
    a metric: a lower bound on the live replicas)."""
    return len(
        {
            dict(lb).get("replica")
            for (_, lb) in samples
            if dict(lb).get("deployment") == deployment and dict(lb).get("replica")
        }
    )
