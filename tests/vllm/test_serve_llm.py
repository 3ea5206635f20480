"""vitserve's connector under Ray Serve LLM (``ray.serve.llm``), set through ``engine_kwargs``.

``serve_llm_app.py`` (its docstring has the recipe) serves the noise-vision copy of the tiny
Qwen2-VL as Ray Serve LLM's OpenAI app, in its own local Ray cluster, with vitserve's
connector in ``engine_kwargs["ec_transfer_config"]``. With vitserve's keys as ``uuid`` s it must
give vLLM alone's answer (replica A, no keys): its own tower, of noise weights, never runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

from .chat import (
    LOGPROB_TOL,
    answer,
    body,
    keys_of,
    logprob_gap,
    png,
    post,
    tokens,
    user,
)
from .conftest import SERVED_NAME, Replica, Vitserve, vllm_python

APP = Path(__file__).with_name("serve_llm_app.py")
READY_TIMEOUT = 300.0


@dataclass
class ServeLlm:
    url: str
    metrics_dir: Path

    def counts(self) -> dict[str, float]:
        """The connector's counters (``vllm:vitserve_ec_*``), from the replica's
        ``PROMETHEUS_MULTIPROC_DIR``: the Serve app has no /metrics."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.metrics_dir))
        out: dict[str, float] = {}
        for family in registry.collect():
            for sample in family.samples:
                name = sample.name
                if name.startswith("vllm:vitserve_ec_") and name.endswith("_total"):
                    key = name.removeprefix("vllm:vitserve_ec_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + sample.value
        return out

    def counts_after(self, name: str, at_least: float, timeout: float = 15) -> dict[str, float]:
        """The counters once ``name`` reached ``at_least`` (vLLM records them after the step),
        or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while (counts := self.counts()).get(name, 0.0) < at_least:
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return counts


def _tail(log: Path, n: int = 6000) -> str:
    data = log.read_bytes() if log.exists() else b""
    return data[-n:].decode(errors="replace")


def _cluster_processes(pgid: int, session_dir: str | None) -> list[psutil.Process]:
    """The processes left of the app's process group or of its Ray cluster."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if proc.info["status"] == psutil.STATUS_ZOMBIE:  # dead, waiting for its reaper
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if os.getpgid(proc.pid) == pgid or (session_dir and session_dir in cmdline):
                left.append(proc)
    return left


def _stop(proc: subprocess.Popen, session_dir: str | None) -> None:
    """SIGTERM to the app (it shuts Serve and Ray down), then its whole process group and
    whatever of its Ray cluster is left; fails if a process of it survives SIGKILL."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        for leftover in _cluster_processes(pgid, session_dir):
            with contextlib.suppress(psutil.Error):
                leftover.send_signal(sig)
        deadline = time.monotonic() + 15
        while _cluster_processes(pgid, session_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    left = [(p.pid, p.name()) for p in _cluster_processes(pgid, session_dir)]
    assert not left, f"processes of the Ray Serve LLM app survived SIGKILL: {left}"


@pytest.fixture(scope="module")
def serve_llm(
    vitserve: Vitserve,
    store: Any,
    noise_model_dir: Path,
    replicas: dict[str, Replica],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServeLlm]:
    """serve_llm_app.py on the noise-vision model, started after replicas A and B (idle, one
    pinned to each core); its engine binds both cores."""
    from vitserve.deployments.runner.local import free_port

    work = tmp_path_factory.mktemp("serve_llm")
    metrics_dir = work / "metrics"
    metrics_dir.mkdir()
    log = work / "app.log"
    port = free_port()
    cmd = [
        vllm_python(),
        str(APP),
        "--model",
        str(noise_model_dir),
        "--port",
        str(port),
        "--vitserve-url",
        vitserve.url,
        "--store",
        store.url,
        "--metrics-dir",
        str(metrics_dir),
        "--served-model-name",
        SERVED_NAME,
        "--check-model",  # its tower is noise on purpose: compare all but the vision weights
        "tower-may-differ",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "VITSERVE_"))}
    env.update(
        RAY_AUTH_MODE="disabled",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0-1",
    )
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    session_dir: str | None = None
    try:
        t0 = time.monotonic()
        while True:
            text = log.read_text(errors="replace")
            ready = [ln for ln in text.splitlines() if ln.startswith("READY ")]
            if ready:
                session_dir = ready[0].split()[2]
                break
            if proc.poll() is not None:
                pytest.fail(f"serve_llm_app.py exited ({proc.returncode}); {log}:\n{_tail(log)}")
            if time.monotonic() - t0 > READY_TIMEOUT:
                pytest.fail(
                    f"Ray Serve LLM not up after {READY_TIMEOUT:.0f} s; {log}:\n{_tail(log)}"
                )
            time.sleep(1)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
        yield ServeLlm(url, metrics_dir)
    finally:
        _stop(proc, session_dir)


def test_ray_serve_llm_with_the_connector_in_engine_kwargs_gives_vllm_alones_answer(
    serve_llm: ServeLlm, vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    """Two new images: Ray Serve LLM's app (noise vision tower) asked with vitserve's keys gives
    replica A's answer without keys (tokens and prompt logprobs); its connector loaded both
    images and ran no fallback. The control, the same request without keys (its own tower),
    gives other tokens."""
    rng = np.random.default_rng(21)
    images = [png(rng, 224, 224), png(rng, 112, 168)]
    alone = answer(post(replicas["a"].url, body([user(images)])))
    keys = keys_of(vitserve.url, images)
    before = serve_llm.counts()
    hit = answer(post(serve_llm.url, body([user(images, uuids=keys)])))
    after = serve_llm.counts_after("loads", before.get("loads", 0.0) + 2)
    control = answer(post(serve_llm.url, body([user(images)])))
    gap = logprob_gap(hit, alone)
    print(f"max |prompt logprob difference| from vLLM alone: {gap:.2g}")
    assert tokens(hit) == tokens(alone)
    assert gap < LOGPROB_TOL, gap
    assert after.get("loads", 0.0) - before.get("loads", 0.0) >= 2, after
    assert after.get("load_fallbacks", 0.0) == 0, after
    assert tokens(control) != tokens(alone)
