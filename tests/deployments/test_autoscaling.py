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
    _, state = decide(WorkStats(2, 0, P), state, params, 2.0)  # measured once ...
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
    }
    stats = stats_from_metrics(2, metrics)
    assert stats == WorkStats(2, 6000.0, P, 1.0)
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
        policy_state={"__decision_counters": 0},
        current_time=100.0,
    )
    replicas, _ = work_policy(ctx)
    assert replicas == 6


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
def test_simulation_work_policy_sizes_by_patches(sim):
    results = sim.run_all()
    for load in sim.LOADS:
        work, req = results[load, "work"][1], results[load, "requests"][1]
        # after the first reaction the work policy keeps new images near the target ...
        assert work["settled_peak_delay_s"] < 4 * sim.TARGET_QUEUE_DELAY_S, (load, work)
        # ... while counting requests mis-sizes the pool (too few, then a backlog) ...
        assert req["settled_peak_delay_s"] > 1.5 * work["settled_peak_delay_s"], (load, req)
        # ... and pays more replica-seconds for it; both scale back down
        assert work["replica_seconds"] < req["replica_seconds"]
        assert work["final_replicas"] == sim.MIN_REPLICAS
