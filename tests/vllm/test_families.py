"""Every family vLLM's CPU build serves: vLLM with vitserve's connector == vLLM alone.

One Serve cluster serves every family's tiny test model (built ``vllm=True``: see
:mod:`vitserve.encoder.testmodels` and ``families.py``), one vitserve application per family,
started the way a Serve config of several applications is run (``serve run config.yaml``, the
``applications:`` a RayService's ``serveConfigV2`` lists too); beside it one vLLM per family
over the same folder with the connector, its ``url`` the family's application. All start at
once: a vLLM start is a chain of three processes that each import vLLM (~20 s of one core each
on a 2-vCPU EPYC), so side by side they fill the cores that one alone leaves idle, and one
Ray cluster serves what five ``vitserve serve`` s would.

Per family, two images of different sizes: vLLM alone (no ``uuid`` s: its own tower) and vLLM
with the images' vitserve keys give the same greedy tokens and prompt logprobs, and the
connector loaded every image. (Qwen2-VL runs in ``test_connector.py``, behind the front.)
Every family in fp32 but Qwen3.5, which vLLM's CPU build serves in bf16 only: there vitserve
encodes in bf16 too, and the prompt logprobs agree to bf16's tolerance (:func:`near_tie_gap`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer
from tests.cli_process import cli_env, wait_healthy
from tests.redis_process import RedisServer

from .chat import (
    BF16_LOGPROB_TOL,
    LOGPROB_TOL,
    answer,
    body,
    delta,
    keys_of,
    logprob_gap,
    near_tie_gap,
    png,
    post,
    tokens,
    user,
)
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    Replica,
    ec_config,
    side_by_side,
    vllm_python,
)
from .families import SIZES, VLLM_FAMILIES

FAMILIES = [f for f in VLLM_FAMILIES if f != "qwen2_vl"]
SERVE = str(Path(sys.executable).parent / "serve")
# vLLM's and vitserve's dtype per family: fp32, but vLLM 0.32's CPU gated-DeltaNet kernels take
# bf16 only ("CPU GDN attention requires BF16."), so Qwen3.5 serves in bf16 on both sides
DTYPES = {"qwen3_5": ("bfloat16", "bf16")}
FP32 = ("float32", "fp32")
# each vLLM's KV cache: the tiny models' 4096 positions take a few MiB; vLLM's CPU build keeps
# the cache resident, so 64 MiB instead of the harness's 1 GiB leaves ~0.9 GiB per server of
# the machine's memory to the rest of the suite (the session's stack is up beside these)
KV_CACHE_BYTES = 64 * 2**20
# each application's share of the cluster's 2 CPUs: all five fit
SHARES = {"encoder.num_cpus": 0.2, "ingress.num_cpus": 0.05, "torch_threads": 1}


def serve_config(models: dict[str, Path], store: str, port: int) -> dict:
    """A Serve config: one vitserve application per family at ``/<family>``, over ``store``."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": family,
                "route_prefix": f"/{family}",
                "import_path": "vitserve.deployments.encoder.app:build_app",
                "args": {
                    "model": str(model),
                    "store": store,
                    "dtype": DTYPES.get(family, FP32)[1],
                    "device": "cpu",
                    **SHARES,
                },
            }
            for family, model in models.items()
        ],
    }


@contextlib.contextmanager
def serve_run(config: dict, work: Path, urls: list[str]) -> Iterator[subprocess.Popen]:
    """``serve run`` of ``config`` on a new local Ray cluster, until every one of ``urls``
    answers its health route; stopped as Ctrl-C stops it (its own signal, then its group)."""
    path = work / "serve.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    log = work / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [SERVE, "run", "--address", "local", str(path)],
            env=cli_env(work / "cache"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        for url in urls:
            wait_healthy(proc, url, timeout=600, log=log)
        yield proc
    finally:
        stop_group(proc)
        sys.stderr.write(f"serve run log: {log}\n")


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """``sig`` to ``proc`` alone (it stops its cluster), then SIGKILL to its process group."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def families(
    store: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[str, Replica]]]:
    """family -> (its vitserve application's URL, its vLLM replica), all started at once."""
    from vitserve.deployments.runner.local import free_port
    from vitserve.encoder.testmodels import cached_model

    work = tmp_path_factory.mktemp("families")
    models = {family: cached_model(family, "tiny", vllm=True) for family in FAMILIES}
    port = free_port()
    urls = {family: f"http://127.0.0.1:{port}/{family}" for family in FAMILIES}
    service = serve_run(serve_config(models, store.url, port), work, list(urls.values()))
    servers = {
        family: VllmServer(
            vllm_python(),
            str(models[family]),
            free_port(),
            dtype=DTYPES.get(family, FP32)[0],
            log_path=str(work / f"vllm-{family}.log"),
            served_model_name=SERVED_NAME,
            ready_timeout=600,  # all at once, beside the cluster's start
            kv_cache_bytes=KV_CACHE_BYTES,
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV},
            # the connector reaches vitserve only when a request names a key
            extra_args=[
                "--ec-transfer-config",
                ec_config(urls[family], store.url),
                *ONE_PROCESS_ARGS,
            ],
        )
        for family in FAMILIES
    }
    with side_by_side(service, *servers.values()):  # one that cannot start fails the module
        yield {family: (urls[family], Replica(family, servers[family])) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_connector_equals_vllm_alone(family: str, families: dict[str, tuple[str, Replica]]) -> None:
    url, replica = families[family]
    rng = np.random.default_rng(11)
    images = [png(rng, w, h) for w, h in SIZES[family]]
    alone = answer(post(replica.url, body([user(images)])))
    keys = keys_of(url, images)
    before = replica.counts()
    hit = answer(post(replica.url, body([user(images, uuids=keys)])))
    moved = delta(before, replica.counts())
    assert tokens(hit) == tokens(alone)
    bf16 = family in DTYPES
    gap = (near_tie_gap if bf16 else logprob_gap)(hit, alone)
    print(f"{family}: max |prompt logprob difference| from vLLM alone {gap:.2g}")
    assert gap < (BF16_LOGPROB_TOL if bf16 else LOGPROB_TOL), gap
    assert moved["loads"] == len(set(keys)) and moved["load_fallbacks"] == 0, moved
