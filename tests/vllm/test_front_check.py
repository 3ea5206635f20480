"""vitserve's vLLM front pointed at a real vLLM started without vitserve's connector (no
``--ec-transfer-config``), as an operator might by mistake: every image would be encoded twice,
once by each tier, silently. The front reads the server's ``/metrics`` (no
``vllm:vitserve_ec_*`` counters): its ``/healthz`` answers 503 ``no_connector`` and a chat is
refused with an error that says what to do, while the same chat sent to vLLM directly is
answered (the server itself is fine)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer
from tests.redis_process import RedisServer

from .chat import answer, body, png, post, tokens, user
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    RayUp,
    Vitserve,
    after,
    side_by_side,
    vitserve_serve,
    vllm_python,
)


@pytest.fixture(scope="module")
def bare(
    model_dir, store: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Vitserve, VllmServer]]:
    """``vitserve serve --vllm-url`` to a vLLM over the same checkpoint without the
    connector, started side by side."""
    from vitserve.deployments.runner.local import free_port

    work = tmp_path_factory.mktemp("bare")
    server = VllmServer(
        vllm_python(),
        str(model_dir),
        free_port(),
        dtype="float32",
        log_path=str(work / "vllm.log"),
        served_model_name=SERVED_NAME,
        ready_timeout=300,
        kv_cache_bytes=64 * 2**20,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV},
        extra_args=[*ONE_PROCESS_ARGS],  # no --ec-transfer-config
    )
    up = RayUp()
    service = vitserve_serve(
        model_dir,
        store.url,
        free_port(),
        work / "serve.log",
        ("--vllm-url", server.url),
        up,
        front_statuses=(200, 503),  # 503 once it has read the server's /metrics
    )
    with side_by_side(service, after(up, server)) as started:
        yield started[0], server


def test_a_front_to_a_vllm_without_the_connector_says_so_and_refuses_chats(bare) -> None:
    service, server = bare
    health = httpx.get(f"{service.url}/vllm/healthz", timeout=30)
    assert health.status_code == 503, health.text
    doc: dict[str, Any] = health.json()
    assert doc["status"] == "no_connector" and doc["backends"] == ["no_connector"]
    assert "without vitserve's connector" in doc["error"]["message"]
    images = [png(np.random.default_rng(21), 64, 48)]
    refused = httpx.post(f"{service.url}/vllm/v1/chat/completions", json=body([user(images)]))
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    assert "--ec-transfer-config" in error["message"], error
    direct = answer(post(server.url, body([user(images)])))  # vLLM itself answers
    assert tokens(direct)
    # one error shape: vLLM's own (OpenAI's) fields are all in the front's, with its status
    theirs = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body([user(images)]), "model": "absent"}
    )
    assert theirs.status_code == 404, theirs.text
    assert set(theirs.json()["error"]) <= set(error), (theirs.json(), error)
    assert error["code"] == 503 and error["param"] is None
    print(f"front to a vLLM without the connector: 503 ({error['message'][:80]}...)")
