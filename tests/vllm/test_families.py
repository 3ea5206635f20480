"""Every family vLLM's CPU build serves: vLLM with vitserve's connector == vLLM alone.

Per family, a ``vitserve serve`` over the family's tiny test model (built ``vllm=True``: see
:mod:`vitserve.encoder.testmodels` and ``families.py``) and one vLLM over the same folder with
the connector, started side by side. Two images of different sizes: vLLM alone (no ``uuid`` s:
its own tower) and vLLM with the images' vitserve keys give the same greedy tokens and prompt
logprobs, and the connector loaded every image. (Qwen2-VL runs in ``test_connector.py``, behind
the front.)
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer
from tests.redis_process import RedisServer

from .chat import (
    LOGPROB_TOL,
    answer,
    body,
    delta,
    keys_of,
    logprob_gap,
    png,
    post,
    tokens,
    user,
)
from .conftest import SERVED_NAME, Replica, ec_config, vitserve_serve, vllm_python
from .families import SIZES, VLLM_FAMILIES

FAMILIES = [f for f in VLLM_FAMILIES if f != "qwen2_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_connector_equals_vllm_alone(family: str, store: RedisServer, tmp_path: Path) -> None:
    from vitserve.deployments.runner.local import free_port
    from vitserve.encoder.testmodels import cached_model

    model = cached_model(family, "tiny", vllm=True)
    rng = np.random.default_rng(11)
    images = [png(rng, w, h) for w, h in SIZES[family]]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = VllmServer(
        vllm_python(),
        str(model),
        free_port(),
        dtype="float32",
        log_path=str(tmp_path / "vllm.log"),
        served_model_name=SERVED_NAME,
        ready_timeout=300,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        extra_args=["--ec-transfer-config", ec_config(url, store.url)],
    )
    # both start at once: the connector reaches vitserve only when a request names a key
    service = vitserve_serve(model, store.url, port, tmp_path / "serve.log")
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = [pool.submit(stack.enter_context, c) for c in (service, server)]
        assert started[0].result().url == url
        started[1].result()  # a server that cannot start fails the test here
        replica = Replica(family, server)
        alone = answer(post(server.url, body([user(images)])))
        keys = keys_of(url, images)
        before = replica.counts()
        hit = answer(post(server.url, body([user(images, uuids=keys)])))
        moved = delta(before, replica.counts())
    assert tokens(hit) == tokens(alone)
    gap = logprob_gap(hit, alone)
    print(f"{family}: max |prompt logprob difference| from vLLM alone {gap:.2g}")
    assert gap < LOGPROB_TOL, gap
    assert moved["loads"] == len(set(keys)) and moved["load_fallbacks"] == 0, moved
