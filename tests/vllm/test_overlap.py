"""The encode overlaps vLLM's work (issue 40), with a real vLLM server (see conftest.py).

Replica C: the session's checkpoint with small prefill chunks (``--max-num-batched-tokens``
128), so a prompt of two images with text between them takes several chunks. Its requests name
their images by the keys ``EncoderClient.submit`` answers at the claims, as the front does.

The deliberately slow encode: the second image's key is claimed in the store by "an encoder
elsewhere" before the request, so vitserve's encoder waits for it (single flight), as it does
for an image another replica is encoding; once that claim ends, vitserve's encoder takes the
image over and publishes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer

from .chat import LOGPROB_TOL, answer, body, delta, image_part, logprob_gap, png, post, tokens
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    Replica,
    Vitserve,
    ec_config,
    vllm_python,
)

POLL_S = 0.005  # the connector's wait_poll_s (its default): a step per poll while waiting
CHUNK = 128  # C's --max-num-batched-tokens: a 224x224 image is 64 rows in the tiny model
FILLER = " ".join(["word"] * 160)  # ~160 tokens: the second image starts past the first chunk


@pytest.fixture(scope="module")
def chunked(
    vitserve: Vitserve, model_dir: Any, store: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replica]:
    from vitserve.deployments.runner.local import free_port

    server = VllmServer(
        vllm_python(),
        str(model_dir),
        free_port(),
        dtype="float32",
        log_path=str(tmp_path_factory.mktemp("vllm-chunked") / "c.log"),
        served_model_name=SERVED_NAME,
        ready_timeout=300,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV},
        extra_args=[
            *ONE_PROCESS_ARGS,
            "--ec-transfer-config",
            ec_config(vitserve.url, store.url),
            "--max-num-batched-tokens",
            str(CHUNK),
        ],
    )
    with server:
        yield Replica("c", server)


def _two_images(first: bytes, second: bytes, uuids: list[str] | None = None) -> dict[str, Any]:
    u = uuids or [None, None]
    content = [
        image_part(first, u[0]),
        {"type": "text", "text": FILLER},
        image_part(second, u[1]),
        {"type": "text", "text": "Compare the two images."},
    ]
    return body([{"role": "user", "content": content}])


def _text_latency(url: str) -> float:
    started = time.perf_counter()
    response = post(url, body([{"role": "user", "content": "Say hi."}], max_tokens=4))
    assert response.status_code == 200, response.text[:300]
    return time.perf_counter() - started


def test_early_chunks_prefill_while_a_later_image_encodes_and_others_go_on(
    vitserve: Vitserve, chunked: Replica, store: Any
) -> None:
    """Two new images with text between them, the second one's encode held: vLLM loads the
    first image and prefills the chunks before the second while the second is still being
    encoded (its claim held, no record), answers another request meanwhile as fast as when
    idle, idles rather than spins while only the waiting request is left (one engine step
    per ``wait_poll_s`` at most, where vLLM's loop would step again at once, taking a core
    from the model's threads and from an encoder beside it), and, once the second image is
    published, answers as vLLM alone does (its own tower, the same server) with both images
    loaded from vitserve and none encoded by vLLM."""
    from vitserve.cache import open_store
    from vitserve.cache.base import Pending
    from vitserve.client import EncoderClient
    from vitserve.client.ec_plan import item_identifier

    c = chunked
    rng = np.random.default_rng(4001)
    first, second = png(rng, 224, 224), png(rng, 224, 224)
    alone = answer(post(c.url, _two_images(first, second)))
    idle = min(_text_latency(c.url) for _ in range(3))

    client = EncoderClient(vitserve.url, store=store.url)
    model = client.describe()
    namespace = model.get("namespace") or ""
    k1, k2 = client.core.keys_of([first, second])
    slow = open_store(store.url, namespace=namespace, fingerprint=model["fingerprint"])
    assert slow.claim(k2, 120, "an-encoder-elsewhere")  # the second image's encode: held
    try:
        submitted = client.submit([first, second])  # the front's call: answered at the claims
        assert [s.pending for s in submitted] == [True, True]
        assert [s.key for s in submitted] == [k1, k2]
        uuids = [item_identifier(namespace, s.key) for s in submitted]
        before = c.counts()
        result: dict[str, httpx.Response] = {}
        waiting = threading.Thread(
            target=lambda: result.setdefault("r", post(c.url, _two_images(first, second, uuids)))
        )
        waiting.start()
        deadline = time.monotonic() + 60
        while delta(before, c.counts()).get("loads", 0) < 1:  # the first image's chunk ran
            assert time.monotonic() < deadline, ("no chunk ran", delta(before, c.counts()))
            time.sleep(0.05)
        assert slow.lookup_states([k2]) == [Pending.CLAIMED]  # the second: still encoding
        during = _text_latency(c.url)
        assert waiting.is_alive()  # it still waits for the second image
        print(f"a text request: {idle * 1e3:.0f} ms idle, {during * 1e3:.0f} ms beside the wait")
        assert during < 2 * idle + 0.5, (during, idle)
        time.sleep(0.5)  # the text request done: only the waiting request is left
        quiet, started = c.counts(), time.monotonic()
        time.sleep(2.0)
        held = delta(quiet, c.counts())
        steps_per_s = held.get("deferrals", 0) / (time.monotonic() - started)
        print(f"engine steps while only the waiting request is left: {steps_per_s:.0f}/s")
        assert waiting.is_alive()
        assert held.get("idle_steps", 0) > 0, held
        assert steps_per_s < 1.5 / POLL_S, (steps_per_s, held)  # one per poll, with slack
        moved = delta(before, c.counts())
        assert moved["deferrals"] > 0 and moved["loads"] == 1, moved
    finally:
        slow.release(k2, "an-encoder-elsewhere")  # vitserve's encoder takes the image over
    waiting.join(120)
    assert not waiting.is_alive()
    doc = answer(result["r"])
    assert tokens(doc) == tokens(alone)
    gap = logprob_gap(doc, alone)
    print(f"max |prompt logprob difference| from vLLM alone {gap:.2g}")
    assert gap < LOGPROB_TOL, gap
    moved = delta(before, c.counts())
    assert moved["loads"] == 2 and moved["hits"] == 2 and moved["misses"] == 0, moved
    # the second image waited for; the first may have been published before vLLM asked
    assert moved["waits"] >= 1 and moved["wait_misses"] == 0, moved
    assert moved["load_fallbacks"] == 0, moved
    client.close()
    slow.close()


def test_a_claim_that_ends_without_a_record_is_a_miss_vllm_encodes(
    vitserve: Vitserve, chunked: Replica, store: Any
) -> None:
    """An image whose claim ends without a record (its encode failed): the waiting request is
    not hung; the image is a counted miss that vLLM encodes from its pixels, and the answer is
    vLLM alone's."""
    from vitserve.cache import open_store
    from vitserve.client import EncoderClient
    from vitserve.client.ec_plan import item_identifier

    c = chunked
    rng = np.random.default_rng(4002)
    first, second = png(rng, 224, 224), png(rng, 112, 112)
    alone = answer(post(c.url, _two_images(first, second)))
    client = EncoderClient(vitserve.url, store=store.url)
    model = client.describe()
    namespace = model.get("namespace") or ""
    k1, k2 = client.core.keys_of([first, second])
    client.encode([first])
    claims = open_store(store.url, namespace=namespace, fingerprint=model["fingerprint"])
    assert claims.claim(k2, 120, "an-encoder-that-fails")
    uuids = [item_identifier(namespace, k) for k in (k1, k2)]
    before = c.counts()
    result: dict[str, httpx.Response] = {}
    waiting = threading.Thread(
        target=lambda: result.setdefault("r", post(c.url, _two_images(first, second, uuids)))
    )
    waiting.start()
    deadline = time.monotonic() + 60
    while delta(before, c.counts()).get("deferrals", 0) < 1:
        assert time.monotonic() < deadline, ("never waited", delta(before, c.counts()))
        time.sleep(0.05)
    claims.release(k2, "an-encoder-that-fails")  # released without a value
    waiting.join(120)
    assert not waiting.is_alive()
    assert tokens(answer(result["r"])) == tokens(alone)
    moved = delta(before, c.counts())
    assert moved["hits"] == 1 and moved["misses"] == 1 and moved["wait_misses"] == 1, moved
    client.close()
    claims.close()
