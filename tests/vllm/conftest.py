"""Real vLLM servers (vLLM's CPU build, from its own venv) beside a real ``vitserve serve``.

``make test-vllm`` builds vLLM's venv (tests/vllm/make_env.sh) and runs this folder with
``VITSERVE_TEST_VLLM=1``. Nothing here skips: a vLLM that cannot start fails the suite.

The session's servers, all on loopback:

* a private ``redis-server`` (the store; the fault tests stop and restart it);
* ``vitserve serve`` over the tiny Qwen2-VL built for vLLM's CPU attention, fp32, the Redis
  store, with the prefill application and the front for vLLM (``--vllm-url`` A and B);
* vLLM replica **A** over the same folder and replica **B** over a copy whose vision weights are
  noise, both with vitserve's connector (``ec_consumer``), one pinned to each core. B answers
  right only when its tower never runs: every image it needs comes from vitserve (its connector
  runs with ``check_model: tower-may-differ``: the default refuses a service whose vision
  weights are not vLLM's, ``tests/vllm/test_vouch.py``). Noise, not
  NaN: a NaN tower's request leaves NaN keys and values in the KV blocks it wrote, vLLM reuses
  those blocks once freed, and B's later answers came out NaN (measured: after one control
  request without keys, the conversation test's B turns failed with vLLM's "Out of range float
  values are not JSON compliant", and B's log showed no fallback to its tower).

A and B run vLLM's default process layout (API server, engine core, worker: the scheduler's
connector metadata crosses to the worker process, pickled). The servers the modules start for
one question each (a family's parity, ``ec_both``, chunked prefill, a black-holed store, a
refusal at start) run the worker inside the engine core (``ONE_PROCESS``): the same connector
code in both roles, one process and one import of vLLM fewer per server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.vllm_peer import VllmServer
from tests.cli_process import VITSERVE, cli_env, wait_healthy
from tests.redis_process import RedisServer

ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny"
CONNECTOR = "VitserveECConnector"
MAX_IMAGES = 16  # vLLM's --limit-mm-per-prompt for images
# vLLM's worker inside its engine core process (vLLM's CPU platform keeps the ``uni`` executor
# only with V1 multiprocessing off; the API server still runs the engine core in a process of
# its own): a start then costs two processes that import vLLM, not three
ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ONE_PROCESS_ARGS = ("--distributed-executor-backend", "uni")
# a vision weight's name in a saved checkpoint (with or without transformers' "model." prefix)
VISION_WEIGHT = re.compile(r"^(model\.)?(visual|vision_tower|multi_modal_projector|embed_vision)\.")


def vllm_python() -> str:
    """vLLM's venv's python (``VITSERVE_VLLM_PYTHON``, else the checkout's ``.venv-vllm``)."""
    path = os.environ.get("VITSERVE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
    if not Path(path).exists():
        pytest.fail(f"no vLLM venv at {path}: `make test-vllm` builds it (tests/vllm/make_env.sh)")
    return path


def ec_config(vitserve_url: str, store: str | None, role: str = "ec_consumer", **extra: Any) -> str:
    """The ``--ec-transfer-config`` that makes a vLLM use vitserve as its encoder tier
    (``role``: ``ec_both`` publishes what vLLM encodes; ``extra``: more of
    ``ec_connector_extra_config``)."""
    settings = {"url": vitserve_url, **({"store": store} if store else {}), **extra}
    return json.dumps(
        {
            "ec_connector": CONNECTOR,
            "ec_connector_module_path": "vitserve.client.vllm",
            "ec_role": role,
            "ec_connector_extra_config": settings,
        }
    )


def noise_vision_copy(src: Path, dst: Path, seed: int = 0) -> Path:
    """A copy of the checkpoint ``src`` whose vision-tower and projector weights each have
    seeded noise of their own mean magnitude added (a tower that gives other embeddings)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in sorted(tensors):
            tensor = tensors[name]
            if VISION_WEIGHT.match(name) and tensor.is_floating_point():
                scale = tensor.float().abs().mean().item() + 0.02  # norms' ones, zero biases
                noise = torch.randn(tensor.shape, generator=generator) * scale
                tensors[name] = (tensor.float() + noise).to(tensor.dtype)
                changed += 1
        save_file(tensors, shard, metadata={"format": "pt"})
    assert changed, f"no vision weight found in {src}"
    return dst


@dataclass
class Vitserve:
    url: str
    proc: subprocess.Popen

    @property
    def front(self) -> str:
        return f"{self.url}/vllm"

    def encoded(self) -> int:
        """Images its encoder replica has encoded (``GET /v1/stats``: the replica's own count,
        exact at once; ``vitserve serve`` runs one encoder replica)."""
        stats = httpx.get(f"{self.url}/v1/stats", timeout=10)
        assert stats.status_code == 200, stats.text
        return stats.json()["encoder"]["images"]


@dataclass
class Replica:
    name: str
    server: VllmServer

    @property
    def url(self) -> str:
        return self.server.url

    def counts(self) -> dict[str, float]:
        """The connector's counters on this replica's /metrics (``vllm:vitserve_ec_*``)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:vitserve_ec_") and "_total" in line:
                name = line.split("{")[0].removeprefix("vllm:vitserve_ec_").removesuffix("_total")
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out


@contextlib.contextmanager
def side_by_side(*servers: contextlib.AbstractContextManager[Any]) -> Iterator[list[Any]]:
    """Enter every one of ``servers`` at once (a vLLM start leaves cores idle that another's
    fills) and yield what each gave; on exit stop them all at once too (a vLLM server's stop
    waits up to 10 s for its group, ``serve run`` up to 60 s). A server that cannot start stops
    the others that did, and its error is raised."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.__enter__) for s in servers]
        entered = [s for s, f in zip(servers, futures, strict=True) if f.exception() is None]
        try:
            yield [f.result() for f in futures]  # the first failure raises here
        finally:
            for stopped in [pool.submit(s.__exit__, None, None, None) for s in entered]:
                stopped.result()


RAY_UP_TIMEOUT = 240.0  # s for a new Ray node and its Serve proxy, beside nothing else


class RayUp:
    """Set once a service's Ray node is up (its Serve proxy answers), or once it failed.

    Ray gives a new node's raylet a fixed 30 s to register with its GCS (``ray.init`` raises
    "The current node timed out during startup" after it, ``ray/_private/node.py``); started
    beside seven vLLMs, each a chain of processes importing vLLM, on 2 vCPUs, it did not (a CI
    run on a 2-vCPU EPYC). So the vLLMs of a fixture start :func:`after` it, the rest of the
    service's start (its applications) still beside them.

    Invariants:
    - it is set exactly when the service's start is past ``ray.init`` or has failed: a server
      waiting :func:`after` it never waits on a service that is gone.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait_for(self, proc: subprocess.Popen, url: str, log: Path | None = None) -> None:
        """Wait until ``url``'s Serve proxy answers (``/-/routes``, before any application),
        then set; set on failure too, and re-raise."""
        try:
            wait_healthy(proc, url, timeout=RAY_UP_TIMEOUT, path="/-/routes", log=log)
        finally:
            self._event.set()

    def wait(self) -> None:
        if not self._event.wait(RAY_UP_TIMEOUT + 60):
            raise AssertionError("the service's Ray node was neither up nor failed")


@contextlib.contextmanager
def after(up: RayUp, server: contextlib.AbstractContextManager[Any]) -> Iterator[Any]:
    """``server`` entered once ``up`` is set (for :func:`side_by_side`)."""
    up.wait()
    with server as started:
        yield started


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from vitserve.testing.models import cached_model

    return cached_model("qwen2_vl", "tiny", vllm=True)


@pytest.fixture(scope="session")
def noise_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noise_vision_copy(model_dir, tmp_path_factory.mktemp("noise") / "tiny-noise-vision")


@pytest.fixture(scope="session")
def store() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def ports() -> dict[str, int]:
    from vitserve.deployments.runner.local import free_port

    return {"vitserve": free_port(), "a": free_port(), "b": free_port()}


@contextlib.contextmanager
def vitserve_serve(
    model: Path,
    store: str,
    port: int,
    log: Path,
    extra: tuple[str, ...] = (),
    up: RayUp | None = None,
    front_statuses: tuple[int, ...] = (200,),
) -> Iterator[Vitserve]:
    """``vitserve serve`` of ``model`` in fp32 on the CPU with ``store``, as a user runs it,
    logging to ``log``; stopped (its process group) on exit. ``up`` is set once its Ray node
    is up; with ``--vllm-url``, the front's ``/healthz`` answers one of ``front_statuses``
    first."""
    url = f"http://127.0.0.1:{port}"
    cmd = [
        VITSERVE,
        "serve",
        "--model",
        str(model),
        "--store",
        store,
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--port",
        str(port),
        *extra,
    ]
    # its metrics reach /metrics every half second (Ray's default: 10 s)
    env = {**cli_env(log.parent / "cache"), "RAY_metrics_report_interval_ms": "500"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        (up or RayUp()).wait_for(proc, url, log)
        wait_healthy(proc, url, timeout=240, log=log)
        if "--vllm-url" in extra:  # the front deploys after the encoder answers
            wait_healthy(proc, url, timeout=120, path="/vllm/healthz", statuses=front_statuses)
        yield Vitserve(url, proc)
    finally:
        # SIGTERM to `vitserve serve` alone, as `kill` or a container's stop sends it: it
        # drains and stops its cluster. (To the whole group, it also killed the replicas it
        # drains: each stop waited out the drain's timeout, ~12 s on a 2-vCPU EPYC.)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever outlived it
        proc.wait()
        sys.stderr.write(f"vitserve serve log: {log}\n")


@pytest.fixture(scope="session")
def stack(
    model_dir: Path,
    noise_model_dir: Path,
    store: RedisServer,
    ports: dict[str, int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Vitserve, dict[str, Replica]]]:
    """The session's ``vitserve serve`` (the prefill application and the front for A and B)
    and replicas A (the checkpoint) and B (its noise-vision copy), the three started side by
    side: a replica's connector reaches vitserve only when a request names a key."""
    extra = (
        "--prefill",
        "--vllm-url",
        f"http://127.0.0.1:{ports['a']}",
        "--vllm-url",
        f"http://127.0.0.1:{ports['b']}",
        "--set",
        f"prefill.served_model_name={SERVED_NAME}",
    )
    log = tmp_path_factory.mktemp("vitserve") / "serve.log"
    up = RayUp()
    service = vitserve_serve(model_dir, store.url, ports["vitserve"], log, extra, up)
    logs = tmp_path_factory.mktemp("vllm")
    url = f"http://127.0.0.1:{ports['vitserve']}"
    # B's tower is deliberately not vitserve's: its connector compares all but the weights
    configs = {
        "a": ec_config(url, store.url),
        "b": ec_config(url, store.url, check_model="tower-may-differ"),
    }
    servers = {
        name: VllmServer(
            vllm_python(),
            str(folder),
            ports[name],
            dtype="float32",
            log_path=str(logs / f"{name}.log"),
            served_model_name=SERVED_NAME,
            ready_timeout=300,
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": core},
            extra_args=["--ec-transfer-config", configs[name]],
            max_images=MAX_IMAGES,
            max_videos=1,  # test_connector.py's video
        )
        for name, folder, core in (("a", model_dir, "0"), ("b", noise_model_dir, "1"))
    }
    vllms = [after(up, server) for server in servers.values()]
    with side_by_side(service, *vllms) as started:  # one that cannot start fails
        yield started[0], {name: Replica(name, srv) for name, srv in servers.items()}


@pytest.fixture(scope="session")
def vitserve(stack: tuple[Vitserve, dict[str, Replica]]) -> Vitserve:
    return stack[0]


@pytest.fixture(scope="session")
def replicas(stack: tuple[Vitserve, dict[str, Replica]]) -> dict[str, Replica]:
    return stack[1]
