"""How long a load point runs and when its requests arrive (pure: no clock, no I/O).

A *point* is one load level of a scenario: a number of closed-loop users, an open-loop arrival
rate, or one step run. Its length follows a :class:`RunLength`: the harness's default is the
publishing rule's (at least ``min_s`` seconds *and* ``min_requests`` requests, the point ends at
the first moment both hold, or at ``max_s`` whichever comes first); ``--run-time T`` gives a
fixed length instead (``min_s = max_s = T``, no request floor), a short development run.

Closed loop (locust users): :func:`users_at` is the user count of a staged load at a time, and
:func:`closed_loop_tick` what locust's shape answers each second: the users, or ``None`` once
the point is done. Open loop: :func:`poisson_arrivals` is the whole arrival schedule, drawn
before the first request is sent, so arrivals never depend on completions.

Invariants:

* ``RunLength.done(t, n)`` holds iff ``t >= max_s`` or (``t >= min_s`` and ``n >= min_requests``);
  it is monotone: once done at ``(t, n)`` it is done for every later ``t`` and larger ``n``.
* :func:`poisson_arrivals`: the gaps between consecutive arrivals (and before the first) are
  independent draws of ``rng.expovariate(rate)``, the same ``rng`` state gives the same
  schedule; the schedule is ascending, every arrival is before ``max_s``, and it ends with the
  first arrival at which it holds ``min_requests`` arrivals and is at or past ``min_s`` (so,
  unless ``max_s`` cut it, it holds at least ``min_requests`` arrivals and its last is at or
  past ``min_s``: the point's window, which ends with its last answer, lasts ``min_s``).
* :func:`users_at` of a time past the last stage is the last stage's users (a point that must
  reach its request floor keeps its last load, it never drops to zero users early).
* Arguments are checked eagerly: a rate, a length or a stage out of range raises ValueError.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PUBLISH_MIN_REQUESTS",
    "PUBLISH_MIN_S",
    "RunLength",
    "closed_loop_tick",
    "poisson_arrivals",
    "users_at",
]

# The publishing rule (issue 29): a published point has at least this many seconds and requests.
PUBLISH_MIN_S = 60.0
PUBLISH_MIN_REQUESTS = 1000


@dataclass(frozen=True)
class RunLength:
    """When a point ends: at ``max_s``, or once both ``min_s`` seconds and ``min_requests``
    requests are reached."""

    min_s: float
    min_requests: int = 0
    max_s: float = math.inf

    def __post_init__(self) -> None:
        if not 0 <= self.min_s <= self.max_s:
            raise ValueError(f"need 0 <= min_s <= max_s, got {self.min_s} and {self.max_s}")
        if self.min_requests < 0:
            raise ValueError(f"min_requests must be >= 0, got {self.min_requests}")

    @classmethod
    def publishing(
        cls,
        max_s: float,
        min_s: float = PUBLISH_MIN_S,
        min_requests: int = PUBLISH_MIN_REQUESTS,
    ) -> RunLength:
        """The publishing rule's length, capped at ``max_s``."""
        return cls(min_s, min_requests, max(max_s, min_s))

    @classmethod
    def fixed(cls, seconds: float) -> RunLength:
        """Exactly ``seconds`` (a development run: no request floor)."""
        return cls(seconds, 0, seconds)

    def done(self, elapsed_s: float, requests: int) -> bool:
        return elapsed_s >= self.max_s or (
            elapsed_s >= self.min_s and requests >= self.min_requests
        )

    def at_least(self, seconds: float) -> RunLength:
        """This length, but never shorter than ``seconds`` (a step load's own stages)."""
        lo = max(self.min_s, seconds)
        return RunLength(lo, self.min_requests, max(self.max_s, lo))


def poisson_arrivals(rate: float, rng: random.Random, length: RunLength) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process of ``rate`` requests/s,
    until ``length`` is done counting arrivals as requests."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate}")
    if math.isinf(length.min_s):
        raise ValueError("an endless schedule: min_s must be finite")
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= length.max_s:
            return out
        out.append(t)
        if length.done(t, len(out)):
            return out


def users_at(stages: Sequence[tuple[float, int]], t: float) -> int:
    """The users of ``stages`` (``[(until_s, users), ...]``, ascending) at ``t`` seconds."""
    if not stages:
        raise ValueError("no stages")
    ends = [until for until, _ in stages]
    if any(b <= a for a, b in itertools.pairwise(ends)) or any(u < 0 for _, u in stages):
        raise ValueError(f"stages must end in ascending order with users >= 0: {stages}")
    for until, users in stages:
        if t < until:
            return users
    return stages[-1][1]


def closed_loop_tick(
    stages: Sequence[tuple[float, int]],
    length: RunLength,
    run_s: float,
    requests: int,
    window_s: float | None = None,
) -> tuple[int, float] | None:
    """locust's ``LoadTestShape.tick`` for a point: ``(users, spawn rate)``, or ``None`` (stop)
    once ``length`` is done. The users follow ``stages`` at ``run_s`` (since the shape
    started); ``length`` counts from ``window_s`` (since the first request started, the
    point's window: it then lasts ``min_s`` whatever the users' start-up took), or from
    ``run_s`` before any request. Users start all at once (spawn rate = users)."""
    if length.done(run_s if window_s is None else window_s, requests):
        return None
    users = users_at(stages, run_s)
    return users, float(max(users, 1))
