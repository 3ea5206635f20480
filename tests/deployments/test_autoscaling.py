"""The work-based autoscaling policy: the pure decision, the config mapping, and a simulation
against Serve's request-count policy (loadtest/sim_autoscaling.py)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.common.serving import WORK_POLICY, deployment_options
from vitserve.deployments.encoder.autoscaling import (
    WorkParams,
    WorkStats,
    decide,
    stats_from_metrics,
    work_policy,
)
from vitserve.errors import ConfigError

P = 1000.0  # patches/s of one replica
PARAMS = WorkParams(
    target_queue_delay_s=2.0,
    upscale_delay_s=5.0,
    downscale_delay_s=60.0,
    min_replicas=1,
    max_replicas=4,
)


def run(ticks: list[tuple[float, WorkStats]], state=None, params=PARAMS) -> list[int]:
    """Feed (time, stats) ticks; each tick's stats carry the previous decision as target."""
    out, state, target = [], dict(state or {}), None
    for now, stats in ticks:
        if target is not None:
            stats = WorkStats(target, stats.backlog_patches, stats.patches_per_s, stats.busy)
        target, state = decide(stats, state, params, now)
        out.append(target)
    return out


def test_scales_up_under_a_backlog_after_the_upscale_delay():
    # 6000 patches at 1000/s with a 2 s target: 3 replicas
    ticks = [(t, WorkStats(1, 6000, P)) for t in (0, 1, 2, 3, 4, 5, 6)]
    assert run(ticks) == [1, 1, 1, 1, 1, 3, 3]


def test_a_dip_restarts_the_upscale_wait_and_the_persistent_level_is_applied():
    backlog = [6000, 6000, 0, 8000, 6000, 8000, 8000, 8000, 8000]  # the dip at t=2
    ticks = [(float(t), WorkStats(1, b, P)) for t, b in enumerate(backlog)]
    # wanted up again from t=3 (4, then 3, then 4...): applied at t=8, the lowest level seen
    assert run(ticks) == [1, 1, 1, 1, 1, 1, 1, 1, 3]


def test_a_step_in_arrivals_asks_for_what_the_new_load_needs_not_only_its_backlog():
    # 1 replica (1000 patches/s, busy) and the backlog growing 2000 patches/s: 3000/s arrive.
    # By the backlog alone (2000, 4000, ... at a 2 s target) it would ask for 1, 2, 3, ...;
    # by arrivals it asks for ceil((3000 / 0.9 + backlog / 2) / 1000) from the second tick.
    ticks = [(float(t), WorkStats(1, 2000.0 * t, P, busy=1.0)) for t in range(8)]
    # with the upscale delay: at t=5 the level wanted all along (2 at t=0, when no growth was
    # known yet), then at once the level of the last 5 s (5 and more, clamped to 4), with no
    # second wait
    assert run(ticks, params=PARAMS) == [1, 1, 1, 1, 1, 2, 4, 4]
    params = WorkParams(upscale_delay_s=0, max_replicas=16)
    wanted = [
        decide(stats, {"backlog": (now - 1, stats.backlog_patches - 2000)}, params, now)[0]
        for now, stats in ticks[1:]
    ]
    assert wanted == [5, 6, 7, 8, 9, 10, 11]
    # a steady backlog of a pool that keeps up: the busy replicas only
    assert decide(WorkStats(3, 500, P, busy=2.4), {"backlog": (0.0, 500)}, params, 1.0)[0] == 3


def test_a_one_tick_spike_in_a_long_want_moves_the_pool_by_the_level_wanted_throughout():
    # wanted: 2 for a long time, one tick of 4 at t=7, then 2 again: never more than 2
    params = WorkParams(upscale_delay_s=5.0, max_replicas=8)
    backlog = [4000] * 7 + [8000] + [4000] * 6
    ticks = [(float(t), WorkStats(1, b, P)) for t, b in enumerate(backlog)]
    out, state, target = [], {"backlog": (-1.0, 4000.0)}, 1
    for now, stats in ticks:
        target, state = decide(WorkStats(target, stats.backlog_patches, P), state, params, now)
        out.append(target)
    assert max(out) == 2 and out[5] == 2


def test_scales_down_only_after_the_downscale_delay():
    ticks = [(float(t), WorkStats(3, 0, P)) for t in range(0, 61, 10)]
    assert run(ticks) == [3, 3, 3, 3, 3, 3, 1]
    # busy replicas hold the pool even with an empty queue: 2.4 busy / 0.9 -> 3
    ticks = [(float(t), WorkStats(3, 0, P, busy=2.4)) for t in range(0, 121, 10)]
    assert set(run(ticks)) == {3}


def test_downscale_wait_resets_when_work_returns():
    backlog = [0, 0, 0, 0, 0, 0, 6000, 0, 0, 0, 0, 0, 0, 0]  # t = 0, 10, ... 130
    ticks = [(10.0 * t, WorkStats(3, b, P)) for t, b in enumerate(backlog)]
    out = run(ticks)
    assert out[:13] == [3] * 13 and out[13] == 1  # 60 s after t=70


def test_clamped_to_min_and_max():
    assert (
        decide(WorkStats(1, 10**9, P), {}, WorkParams(upscale_delay_s=0, max_replicas=4), 0.0)[0]
        == 4
    )
    params = WorkParams(downscale_delay_s=0, min_replicas=2, max_replicas=4)
    assert decide(WorkStats(4, 0, P), {}, params, 0.0)[0] == 2
    assert decide(WorkStats(9, 0, P, busy=9), {}, params, 0.0)[0] == 4  # target above max


def test_zero_throughput_holds_then_uses_the_remembered_rate():
    params = WorkParams(upscale_delay_s=0, downscale_delay_s=0, max_replicas=8)
    replicas, state = decide(WorkStats(2, 10**6, None), {}, params, 0.0)
    assert replicas == 2  # nothing measured yet: no guess
    replicas, state = decide(WorkStats(2, 10**6, 0.0), state, params, 1.0)
    assert replicas == 2
    _, state = decide(WorkStats(2, 6000, P), state, params, 2.0)  # measured once ...
    replicas, state = decide(WorkStats(1, 6000, None), state, params, 3.0)  # ... then idle
    assert replicas == 3 and state["patches_per_s"] == P


def test_state_is_not_mutated():
    state = {"patches_per_s": P}
    decide(WorkStats(1, 6000, P), state, PARAMS, 0.0)
    assert state == {"patches_per_s": P}


def test_work_policy_adapts_serve_context():
    metrics = {
        "queued_patches": {"r1": 5000.0, "r2": 0.0},
        "running_patches": {"r1": 1000.0},
        "patches_per_s": {"r1": P, "r2": 0.0},
        "busy_fraction": {"r1": 1.0, "r2": 0.0},
        "call_patches": {"r1": 500.0, "r2": 0.0},
    }
    stats = stats_from_metrics(2, metrics)
    assert stats == WorkStats(2, 6000.0, P, 1.0)
    # 4 calls waiting in the routers, at the mean patches of a call (500): 2000 more
    assert stats_from_metrics(2, metrics, 4.0) == WorkStats(2, 8000.0, P, 1.0)
    assert stats_from_metrics(2, {**metrics, "call_patches": {}}, 4.0).backlog_patches == 6000
    ctx = SimpleNamespace(
        config=SimpleNamespace(
            policy=SimpleNamespace(
                policy_kwargs={
                    "target_queue_delay_s": 1.0,
                    "upscale_delay_s": 0.0,
                    "downscale_delay_s": 0.0,
                }
            )
        ),
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=10,
        target_num_replicas=2,
        aggregated_metrics=metrics,
        total_queued_requests=4.0,
        policy_state={"__decision_counters": 0},
        current_time=100.0,
    )
    replicas, _ = work_policy(ctx)
    # arrivals 1000/s (busy x throughput) at 0.9 utilization, and 8000 patches of backlog to
    # work off within 1 s: ceil((1111 + 8000) / 1000)
    assert replicas == 10


# -- config ---------------------------------------------------------------------------------
def test_work_policy_config_builds_serve_options():
    from ray.serve.config import AutoscalingConfig as ServeAutoscaling

    cfg = VitserveConfig.load(
        {
            "encoder.autoscaling.policy": "work",
            "encoder.autoscaling.max_replicas": 2,
            "encoder.autoscaling.upscale_delay_s": 1,
            "encoder.autoscaling.downscale_delay_s": 8,
        }
    )
    a = deployment_options(cfg.encoder)["autoscaling_config"]
    policy = a["policy"]
    assert policy["policy_function"] == WORK_POLICY
    assert policy["policy_kwargs"] == {
        "target_queue_delay_s": 2.0,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 8.0,
    }
    assert a["upscale_delay_s"] == a["downscale_delay_s"] == 0.0  # ours apply, not Serve's
    module, name = WORK_POLICY.split(":")
    assert getattr(importlib.import_module(module), name) is work_policy
    with pytest.warns(DeprecationWarning):  # metrics_interval_s: still Serve 2.60's knob
        serve_cfg = ServeAutoscaling(**a)  # Serve accepts and imports it
    assert serve_cfg.policy.get_policy() is not None
    assert serve_cfg.max_replicas == 2


def test_requests_policy_is_serves_request_count_policy_with_vitserves_delays():
    cfg = VitserveConfig.load({"encoder.autoscaling.max_replicas": 3})
    a = deployment_options(cfg.encoder)["autoscaling_config"]
    assert "policy" not in a and a["target_ongoing_requests"] == 8.0
    assert (a["upscale_delay_s"], a["downscale_delay_s"]) == (5.0, 60.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"encoder.autoscaling.policy": "patches"},
        {"encoder.autoscaling.target_queue_delay": 1.0},
        {"encoder.autoscaling.target_queue_delay_s": 0},
        {"encoder.autoscaling.upscale_delay_s": -1},
    ],
)
def test_bad_autoscaling_fields_fail(bad):
    with pytest.raises(ConfigError):
        VitserveConfig.load(bad)


# -- simulation -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim():
    return importlib.import_module("loadtest.sim_autoscaling")


@pytest.mark.slow
def test_simulation_work_policy_and_router_hold_the_target_and_beat_serves(sim):
    """The must-show of the routing issue, on the published page's runs (5 seeds pooled)."""
    results = sim.run_all(configs=(sim.OURS, sim.THEIRS))
    for load in sim.LOADS:
        ours, theirs = results[(load, *sim.OURS)].pooled, results[(load, *sim.THEIRS)].pooled
        # after the first reaction, vitserve's policy and router keep the target ...
        assert ours["settled_peak_delay_s"] <= 1.5 * sim.TARGET_QUEUE_DELAY_S, (load, ours)
        # ... over the whole load, transient included, they are no worse than Serve's ...
        assert ours["peak_delay_s"] <= theirs["peak_delay_s"], (load, ours, theirs)
        assert ours["p95_delay_s"] <= theirs["p95_delay_s"], (load, ours, theirs)
        # ... for fewer replica-seconds, and the pool scales back down
        assert ours["replica_seconds"] < theirs["replica_seconds"], (load, ours, theirs)
        assert ours["final_replicas"] == sim.MIN_REPLICAS
