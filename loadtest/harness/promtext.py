"""Prometheus text pages (the service's ``GET /metrics``) to numbers: samples summed over the
labels a caller does not group by, deltas between two pages, histogram bucket counts."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """``(name, sorted label pairs) -> value`` of every sample (prometheus_client's parser)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            out[key] = out.get(key, 0.0) + sample.value
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
