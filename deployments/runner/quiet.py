"""The embedded cluster's timers: Ray's and Serve's periodic work at the rate one node needs.

Rule: a cluster that ``vitserve serve`` starts for itself (one local node, nothing joins it)
runs Serve's control loop and metrics export at the rates below, not at Ray's defaults. Idle,
its processes share the host's cores with the encoder's forward; Serve's controller and the GCS
it polls were the largest part of that cost. ``loadtest/bench_idle.py`` measures it, process by
process, with Ray's values and with these (its page is linked from the README): the rest is
each Ray process's own threads, which no setting here reaches.

Invariants:
- a setting is applied only where the environment leaves it unset: an operator's own value
  (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1``) wins, and ``RAY_DEFAULTS`` restores Ray's;
- applied to this process's environment before ``ray.init`` starts the node, so every process
  of the node (the controller, the proxy, each replica) inherits it;
- applied only when this process starts the cluster: a cluster it joins is someone else's;
- each setting names what it delays and by how much at most (``QUIET``); none turns a
  mechanism off.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Timer:
    """One of Ray's or Serve's environment settings: vitserve's value, Ray's default, and what
    the slower rate delays."""

    env: str
    value: str
    ray_default: str
    delays: str


QUIET: tuple[Timer, ...] = (
    Timer(
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S",
        "0.5",
        "0.1",
        "the controller's reconciling: a deploy, a replica's start or stop, an autoscaling "
        "decision act up to 0.4 s later",
    ),
    Timer(
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS",
        "1000",
        "100",
        "Serve's cached request metrics reach Ray's metrics agent up to 0.9 s later (the agent "
        "exports every few seconds anyway)",
    ),
)
#: vitserve's values, by setting
QUIET_ENV: dict[str, str] = {t.env: t.value for t in QUIET}
#: Ray's own values of the same settings (a benchmark's baseline, or an operator's way back)
RAY_DEFAULTS: dict[str, str] = {t.env: t.ray_default for t in QUIET}


def apply(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each of ``QUIET`` that ``env`` (default: this process's environment) leaves unset;
    the settings applied."""
    target = os.environ if env is None else env
    applied = {k: v for k, v in QUIET_ENV.items() if k not in target}
    target.update(applied)
    return applied
