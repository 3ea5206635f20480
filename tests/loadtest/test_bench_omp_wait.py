"""The OpenMP wait benchmark's accounting (``loadtest/bench_omp_wait.py``), without a model:
each trial's process gets the policy (or none) and the niceness its setup names, a busy core
beside it where the setup says so, and the page's medians and ratios."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

import pytest

from loadtest import bench_omp_wait as b


class Fake:
    """``subprocess`` for ``b.trial``: records what it was asked to run."""

    def __init__(self, returncode: int = 0) -> None:
        self.runs: list[tuple[list[str], dict[str, str]]] = []
        self.hogs: list[list[str]] = []
        self.killed = 0
        self.returncode = returncode

    def Popen(self, cmd: list[str], **_: Any) -> Any:  # subprocess.Popen, by its name
        self.hogs.append(cmd)
        fake = self

        class Hog:
            def kill(self) -> None:
                fake.killed += 1

            def wait(self) -> int:
                return -9

        return Hog()

    def run(self, cmd: list[str], env: dict[str, str], **_: Any) -> Any:
        self.runs.append((cmd, env))
        out = json.dumps({"wall_s": 2.0, "cpu_s": 3.0, "threads": 2})
        return subprocess.CompletedProcess(cmd, self.returncode, out + "\n", "boom")


@pytest.mark.parametrize("setup", list(b.SETUPS))
@pytest.mark.parametrize("policy", list(b.POLICIES))
def test_a_trial_runs_its_setup_with_its_policy(monkeypatch, setup: str, policy: str) -> None:
    fake = Fake()
    monkeypatch.setattr(b, "subprocess", fake)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own is never passed on
    args = argparse.Namespace(images=2, side=64)
    got = b.trial(setup, policy, args)
    assert got == b.Trial(setup, policy, 2.0, 3.0)
    [(cmd, env)] = fake.runs
    assert env.get("OMP_WAIT_POLICY") == b.POLICIES[policy]
    assert (cmd[:3] == ["nice", "-n", "19"]) == (setup == "nice19")
    assert cmd[-3:] == ["--child", "2", "64"]
    assert len(fake.hogs) == fake.killed == (0 if setup == "alone" else 1)


def test_a_failed_trial_says_why_and_stops_its_busy_core(monkeypatch) -> None:
    fake = Fake(returncode=1)
    monkeypatch.setattr(b, "subprocess", fake)
    with pytest.raises(RuntimeError, match="boom"):
        b.trial("beside", "PASSIVE", argparse.Namespace(images=1, side=64))
    assert fake.killed == 1


def test_the_page_gives_medians_and_passive_over_default(monkeypatch) -> None:
    monkeypatch.setattr(b, "machine", lambda: {"cpus": "2"})  # not lscpu, not git: no process
    monkeypatch.setattr(b, "git_state", lambda: "`abc1234`")
    trials = [
        b.Trial("nice19", "default", 16.0, 16.0),
        b.Trial("nice19", "PASSIVE", 12.0, 12.0),
        b.Trial("nice19", "default", 18.0, 20.0),
        b.Trial("nice19", "PASSIVE", 13.0, 13.0),
        b.Trial("nice19", "default", 40.0, 30.0),  # an outlier: the median ignores it
        b.Trial("nice19", "PASSIVE", 11.0, 11.0),
    ]
    args = argparse.Namespace(images=2, side=1536, rounds=3, setups=["nice19"])
    text = "\n".join(b.page(args, trials, "now"))
    row = "| at nice 19, a busy core beside at nice 0 | 18.0 | 20.0 | 12.0 | 12.0 | 0.67x | 0.60x |"
    assert row in text
    assert "- nice19, default: 40.00, 30.00" in text
    assert "--setups nice19" in text
