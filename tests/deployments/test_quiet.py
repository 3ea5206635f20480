"""The embedded cluster's timers (``runner.quiet``): applied where the environment leaves them
unset, an operator's own value kept. That they reach the node's Serve processes is shown on a
real ``vitserve serve`` (``test_exposure``); what they save, by ``loadtest/bench_idle.py``."""

from __future__ import annotations

from vitserve.deployments.runner import quiet


def test_unset_timers_get_vitserves_values() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert quiet.apply(env) == quiet.QUIET_ENV
    assert env == {"PATH": "/bin", **quiet.QUIET_ENV}


def test_an_operators_value_wins_and_rays_defaults_restore_ray() -> None:
    name = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    env = {name: "0.05"}
    applied = quiet.apply(env)
    assert name not in applied and env[name] == "0.05"
    assert env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
    env = dict(quiet.RAY_DEFAULTS)
    assert quiet.apply(env) == {} and env == quiet.RAY_DEFAULTS


def test_each_timer_is_slower_than_rays_and_says_what_it_delays() -> None:
    for timer in quiet.QUIET:
        assert float(timer.value) > float(timer.ray_default), timer
        assert timer.delays and timer.env.startswith("RAY_")
