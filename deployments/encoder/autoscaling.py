"""Autoscaling the encoder on work (patches), not on requests.

A request can cost 100x another (one 224px thumbnail: 256 patches; 32 720p frames: ~153k), so
Serve's default signal, ongoing requests per replica, sizes the encoder pool by the wrong unit.
Here each encoder replica reports, through Serve's ``record_autoscaling_stats`` hook
(``EncoderDeployment.record_autoscaling_stats``), its queued and running patches, its patch
throughput while busy, its busy fraction and the mean patches of the calls it admitted (the five
names below); Serve averages each over ``look_back_period_s`` and hands them to
:func:`work_policy` in ``ctx.aggregated_metrics``, with the calls waiting in the routers for a
replica with room (``ctx.total_queued_requests``: the encoder's router holds a backlog in front
of the pool, :mod:`~vitserve.deployments.encoder.routing`), counted here at the mean patches
per call.

:func:`decide` is the whole decision, pure and I/O-free; :func:`work_policy` adapts Serve's
``AutoscalingContext`` to it. Its parameters travel in the Serve config's
``policy.policy_kwargs`` (built by
:func:`vitserve.deployments.common.serving.serve_autoscaling_config`), which Ray 2.60 passes
only to class policies, so the function reads them from ``ctx.config.policy.policy_kwargs``.
The delays are applied here, so Serve's own ``upscale_delay_s``/``downscale_delay_s`` are set
to 0 for this policy (Serve wraps every custom policy in its delay logic; both would add up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The custom metrics an encoder replica reports (``record_autoscaling_stats``).
QUEUED_PATCHES = "queued_patches"  # patches waiting for the device
RUNNING_PATCHES = "running_patches"  # patches of the device step now running
PATCHES_PER_S = "patches_per_s"  # patches per busy device-second, recent window (0: none ran)
BUSY_FRACTION = "busy_fraction"  # share of the recent window the device was busy
CALL_PATCHES = "call_patches"  # mean patches of the calls admitted in the recent window

#: The window a replica measures its throughput and busy fraction over.
STATS_WINDOW_S = 10.0
#: The busy fraction a replica may run at: the pool never shrinks below
#: ceil(sum of busy fractions / TARGET_UTILIZATION), so a pool that keeps its queue short
#: only because it has enough replicas is not scaled down into a backlog.
TARGET_UTILIZATION = 0.9


@dataclass(frozen=True, slots=True)
class WorkParams:
    target_queue_delay_s: float = 2.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    min_replicas: int = 1
    max_replicas: int = 1
    target_utilization: float = TARGET_UTILIZATION


@dataclass(frozen=True, slots=True)
class WorkStats:
    """The pool as the autoscaler sees it: ``target`` replicas wanted now (some may still be
    starting), patches queued + running on all replicas plus those waiting in the routers, the
    mean measured throughput of one busy replica (patches/s; 0 or None: none measured) and the
    sum of the busy fractions."""

    target: int
    backlog_patches: float
    patches_per_s: float | None
    busy: float = 0.0


def decide(
    stats: WorkStats, state: Mapping[str, Any], params: WorkParams, now: float
) -> tuple[int, dict[str, Any]]:
    """The replica count to run, and the state to pass to the next call.

    raw = ceil((arrivals / target_utilization + backlog / target_queue_delay_s) / throughput),
    clamped to [min_replicas, max_replicas]: enough replicas to keep up with the work arriving
    at the utilization they may run at, and to work off the backlog within the target delay.
    ``arrivals`` (patches/s) is the work done (busy x throughput) plus the backlog's growth
    since the previous call (0 at the first; never below 0 in all), so a pool that falls
    behind a step in load asks for what the new load needs at once, not only for the backlog
    it has built so far; with the backlog steady it is ceil(busy / target_utilization) (the
    pool keeping up only because it is large enough is not scaled down into a backlog).

    Invariants:

    * The result is always within [min_replicas, max_replicas]; with no throughput measured
      yet (none now and none remembered) raw is the current target (never a guess), and the
      last measured throughput is remembered in ``state`` across idle periods.
    * A change is applied only after it has been wanted continuously for the delay of its
      direction (``upscale_delay_s`` above the target, ``downscale_delay_s`` below); any tick
      that wants the target itself, or the other direction, restarts the wait.
    * What is applied is the level every tick of the last delay wanted (the smallest raw of the
      last ``upscale_delay_s`` going up, the largest of the last ``downscale_delay_s`` going
      down): a one-tick spike or dip never moves the pool by more than what was wanted for a
      whole delay. While the want goes on, the pool follows that level tick by tick, without
      a new wait for each step (a pool behind a step in load reaches its size one delay after
      the want reached it, not one delay per level on the way).
    * ``state`` holds the ticks of the last delay at most (a tick every second or so: a few
      hundred entries for a 60 s downscale delay).
    * Pure: no clock, no I/O; ``state`` is not mutated (a new dict is returned).
    """
    lo, hi = params.min_replicas, max(params.min_replicas, params.max_replicas)
    target = min(max(stats.target, lo), hi)
    tput = stats.patches_per_s if stats.patches_per_s else state.get("patches_per_s")
    last = state.get("backlog")  # (time, backlog) at the previous call
    growth = 0.0
    if last is not None and now > last[0]:
        growth = (stats.backlog_patches - last[1]) / (now - last[0])
    if tput:
        arrivals = max(0.0, stats.busy * tput + growth)
        need = arrivals / params.target_utilization
        need += stats.backlog_patches / params.target_queue_delay_s
        raw = min(max(math.ceil(need / tput - 1e-9), lo), hi)
    else:
        raw = target
    new: dict[str, Any] = {"patches_per_s": tput, "backlog": (now, stats.backlog_patches)}
    direction = (raw > target) - (raw < target)
    if direction == 0:
        return target, new
    delay = params.upscale_delay_s if direction > 0 else params.downscale_delay_s
    if state.get("direction") == direction and state.get("since") is not None:
        since = state["since"]
        wanted = [(t, r) for t, r in state.get("wanted", ()) if t >= now - delay - 1e-9]
    else:
        since, wanted = now, []
    wanted.append((now, raw))
    new |= {"direction": direction, "since": since, "wanted": wanted}
    if now - since + 1e-9 < delay:
        return target, new
    # the level every call of the last delay wanted (it still wants this direction now)
    level = (min if direction > 0 else max)(r for _, r in wanted)
    if (level > target) if direction > 0 else (level < target):
        return level, new
    return target, new


def stats_from_metrics(
    target: int, metrics: Mapping[str, Mapping[Any, float]], waiting_calls: float = 0.0
) -> WorkStats:
    """:class:`WorkStats` from Serve's aggregated custom metrics (metric -> replica -> value)
    and the calls waiting in the routers (``waiting_calls``, counted at the replicas' mean
    patches per call; none measured: not counted)."""

    def total(name: str) -> float:
        return float(sum(metrics.get(name, {}).values()))

    def mean(name: str) -> float | None:
        values = [v for v in metrics.get(name, {}).values() if v > 0]
        return sum(values) / len(values) if values else None

    waiting = max(0.0, waiting_calls) * (mean(CALL_PATCHES) or 0.0)
    return WorkStats(
        target=target,
        backlog_patches=total(QUEUED_PATCHES) + total(RUNNING_PATCHES) + waiting,
        patches_per_s=mean(PATCHES_PER_S),
        busy=total(BUSY_FRACTION),
    )


def params_from(kwargs: Mapping[str, Any], min_replicas: int, max_replicas: int) -> WorkParams:
    names = ("target_queue_delay_s", "upscale_delay_s", "downscale_delay_s")
    known = {k: kwargs[k] for k in names if k in kwargs}
    return WorkParams(min_replicas=min_replicas, max_replicas=max_replicas, **known)


def work_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's custom policy (``AutoscalingPolicy(policy_function=serving.WORK_POLICY)``): Ray
    calls it with an ``AutoscalingContext`` every control-loop tick and keeps the returned
    state (``ctx.policy_state`` next time). Serve then applies its scaling factors, its own
    delays (0 for this policy) and the capacity-adjusted bounds."""
    policy = getattr(ctx.config, "policy", None)
    kwargs = getattr(policy, "policy_kwargs", None) or {}
    params = params_from(
        kwargs, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    )
    stats = stats_from_metrics(
        ctx.target_num_replicas,
        ctx.aggregated_metrics or {},
        getattr(ctx, "total_queued_requests", None) or 0.0,
    )
    state = {k: v for k, v in (ctx.policy_state or {}).items() if not k.startswith("__")}
    return decide(stats, state, params, ctx.current_time)
