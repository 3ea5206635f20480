"""``loadtest/cpu_by_role.py``: roles from command lines, CPU charged to them between readings,
and per-step figures from the markers `.ci/run` writes."""

from __future__ import annotations

import json
import os
import time

import pytest

from loadtest.cpu_by_role import Sampler, page, read_processes, role_of, steps_cpu


@pytest.mark.parametrize(
    ("cmdline", "role"),
    [
        (
            ["ray::ServeReplica:main:EncoderDeployment.initialize_and_get_metadata"],
            "ServeReplica:EncoderDeployment.initialize_and_get_metadata",
        ),
        (["ray::ServeReplica:fam-llava:Ingress"], "ServeReplica:Ingress"),
        (
            ["ray::SERVE_REPLICA::main#Ingress#ab12:ServeReplica:Ingress.__init__"],
            "ServeReplica:Ingress (starting)",
        ),
        (["ray::ServeController.listen_for_change"], "ServeController.listen_for_change"),
        (["ray::IDLE"], "IDLE"),
        (["VLLM::EngineCore", "VLLM::EngineCore"], "EngineCore"),
        (["/v/lib/ray/core/src/ray/gcs/gcs_server", "--port=1"], "gcs_server"),
        (["/v/bin/python", "/v/ray/_private/log_monitor.py", "--x"], "log_monitor.py"),
        ([".venv/bin/python", "-m", "pytest", "-q"], "pytest"),
        (
            ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"],
            "python -m vllm.entrypoints.openai.api_server",
        ),
        (
            ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
            "python (multiprocessing child)",
        ),
        (["python", "-c", "print(1)"], "python -c"),
        (
            ["/usr/bin/python3", "/x/loadtest/bench_client_fetch.py", "--seconds", "3"],
            "python3 bench_client_fetch.py",
        ),
        (["/usr/bin/redis-server", "127.0.0.1:6379"], "redis-server"),
        ([], "kernel or exited"),
    ],
)
def test_a_process_is_known_by_its_role_not_its_application(cmdline, role) -> None:
    assert role_of(cmdline) == role


def test_cpu_between_readings_goes_to_the_latest_role_and_nothing_before_the_first() -> None:
    sampler = Sampler()
    sampler.read({(1, 10): ("IDLE", 5.0), (2, 20): ("raylet", 100.0)})
    assert sum(sampler.totals.values()) == 0  # what ran before the sampler is not counted
    sampler.read(
        {
            (1, 10): ("ServeReplica:Ingress", 7.0),
            (2, 20): ("raylet", 100.5),
            (3, 30): ("pytest", 1.0),
        }
    )  # a new process counts from its own start
    assert sampler.totals == {"ServeReplica:Ingress": 2.0, "raylet": 0.5, "pytest": 1.0, "IDLE": 0}
    sampler.read({(2, 20): ("raylet", 101.0), (1, 11): ("IDLE", 0.25)})  # pid 1 reused
    assert sampler.totals["raylet"] == 1.0 and sampler.totals["IDLE"] == 0.25


def test_this_process_is_read_from_proc_with_its_cpu_growing() -> None:
    me = [k for k in read_processes() if k[0] == os.getpid()]
    assert len(me) == 1
    before = read_processes()[me[0]][1]
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert read_processes()[me[0]][1] - before >= 0.2


def _lines(*docs: dict) -> list[str]:
    return [json.dumps(d) for d in docs]


def test_a_steps_cpu_is_the_difference_of_the_snapshots_nearest_its_markers() -> None:
    lines = _lines(
        {"t": 100.0, "cpu": {"pytest": 0.0}},
        {"t": 100.5, "step": "make test", "event": "start"},
        {"t": 110.0, "cpu": {"pytest": 8.0, "raylet": 2.0}},
        {"t": 120.0, "cpu": {"pytest": 15.0, "raylet": 5.0}},
        {"t": 120.2, "step": "make test", "event": "end"},
        {"t": 121.0, "step": "unfinished", "event": "start"},
    )
    [step] = steps_cpu(lines)
    assert step.step == "make test" and step.wall == pytest.approx(19.7)
    assert step.cpu == 20.0 and step.roles == (("pytest", 15.0), ("raylet", 5.0))
    assert step.span == 20.0 and step.busy(cores=2) == 0.5  # over the snapshots' 20 s
    table = page([step], cores=2, top=1)
    assert "| `make test` | 20 s | 20 | 50% | pytest 15 |" in table


def test_a_line_that_is_neither_snapshot_nor_marker_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="line 2"):
        steps_cpu([*_lines({"t": 1.0, "cpu": {}}), '{"t": 2}'])
