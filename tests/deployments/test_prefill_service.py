"""The prefill application as a service beside the encoder application: rows pulled per chunk,
the multi-turn agent scenario over HTTP, and each application restarted or scaled while the
other keeps answering. The tiny Qwen2-VL model, a Redis store shared by both applications."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vitserve.testing.images import make_image

CHUNK = 32
_seed = iter(range(50_000, 10**9))


def fresh_images(n: int, sizes: tuple[tuple[int, int], ...] = ((64, 48), (96, 72))) -> list[bytes]:
    """Images never sent before in this session (new seeds), sizes in turn."""
    return [make_image(*sizes[k % len(sizes)], seed=next(_seed)) for k in range(n)]


def data_url(image: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image).decode()


def user_turn(text: str, images: list[bytes]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": parts}


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "temperature": 0, "max_tokens": 3, **extra}


@pytest.fixture(scope="module")
def pair(redis_app, deploy_prefill) -> Iterator[Any]:
    """The prefill application over the suite's shared Redis application."""
    chat = deploy_prefill("pfs-llm", redis_app, **{"prefill.chunk_size": CHUNK})
    yield chat
    deploy_prefill.remove(chat.name)


@pytest.fixture(scope="module")
def own_pair(deploy, deploy_prefill, redis_url) -> Iterator[Any]:
    """A pair of its own, for the tests that kill and scale its replicas (the system tier)."""
    encoder = deploy("pfs-restarts", store=redis_url)
    chat = deploy_prefill("pfs-restarts-llm", encoder, **{"prefill.chunk_size": CHUNK})
    yield chat
    deploy_prefill.remove(chat.name)
    deploy.remove(encoder.name)


# -- rows per chunk -------------------------------------------------------------------------------
def test_each_chunk_pulls_only_the_rows_it_covers(pair, redis_url) -> None:
    """The chat service's prefill (the replicas' code, here in-process with a direct Redis
    client): per chunk one batched store read of exactly the rows of the placeholders inside
    it, its bytes counted by the store."""
    from tests.store_reads import expected_read_bytes
    from vitserve.cache import open_store
    from vitserve.client import EncoderClient
    from vitserve.client.chunks import plan_chunk
    from vitserve.deployments.prefill.chat_service import ChatService

    images = fresh_images(3, sizes=((320, 320), (64, 48), (200, 120)))
    with EncoderClient(pair.encoder.url, store=redis_url) as client:
        model = client.describe()
        store = client.core.store
        calls: list[tuple[list[tuple[str, int, int]], int]] = []
        real = store.get_rows_many

        def counted(reads: list[tuple[str, int, int]], headers: Any = None) -> Any:
            before = store.stats()["bytes_read"]
            out = real(reads, headers)
            calls.append((list(reads), store.stats()["bytes_read"] - before))
            return out

        store.get_rows_many = counted
        service = ChatService(pair.config, client)
        prepared = service.prepare(body([user_turn("three:", images)]))
    layout = prepared.prefilled.layout
    tokens = [s.num_tokens for s in layout.spans]
    assert len(set(tokens)) == 3 and max(tokens) > 2 * CHUNK, tokens
    print(f"image rows {tokens}, chunks of {CHUNK}")
    checker = open_store(redis_url, namespace=model["namespace"], fingerprint=model["fingerprint"])
    handles_keys = _keys(images, model)
    chunks = prepared.prefilled.chunks
    with_images = [c for c in chunks if plan_chunk(layout.spans, c.start, c.end)]
    assert len(calls) == len(with_images) > 3  # text-only chunks read nothing
    first_read = set(handles_keys)  # the client had no header cached before this prompt
    for chunk, (reads, moved) in zip(with_images, calls, strict=True):
        pieces = plan_chunk(layout.spans, chunk.start, chunk.end)
        want = [(handles_keys[p.image], p.row_start, p.row_end) for p in pieces]
        assert reads == want, (chunk.start, chunk.end)
        assert chunk.rows == sum(p.rows for p in pieces)
        assert moved == expected_read_bytes(checker, want, first_read), (chunk.start, chunk.end)
    largest = tokens.index(max(tokens))
    row_bytes = prepared.usage["bytes_pulled"] / sum(tokens)
    inside = [
        m
        for (reads, m) in calls
        if len(reads) == 1
        and reads[0][0] == handles_keys[largest]
        and reads[0][2] - reads[0][1] == CHUNK
    ]
    assert inside and max(inside) < tokens[largest] * row_bytes / 2  # never the whole image
    assert prepared.usage["rows_pulled"] == sum(tokens)
    checker.close()


def _keys(images: list[bytes], model: dict[str, Any]) -> list[str]:
    from vitserve.keys import content_key

    return [content_key(i, model["fingerprint"], model.get("namespace") or "") for i in images]


# -- the model list ------------------------------------------------------------------------------
def test_v1_models_answers_in_openais_shape(pair) -> None:
    """``GET /v1/models`` lists the served model as OpenAI's client reads it (it was a 404)."""
    import openai

    served = pair.config.prefill.served_model_name or pair.config.model
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    assert (model.id, model.object, model.owned_by) == (served, "model", "vitserve")
    assert isinstance(model.created, int) and model.created > 1_600_000_000
    doc = pair.client.get(f"{pair.url}/v1/models").json()
    assert doc == {
        "object": "list",
        "data": [
            {"id": served, "object": "model", "created": model.created, "owned_by": "vitserve"}
        ],
    }


# -- the multi-turn agent scenario ----------------------------------------------------------------
def test_multi_turn_chat_uploads_and_encodes_one_image_per_turn(pair) -> None:
    """Each turn re-sends the whole conversation plus one new image: after turn 1 one image is
    uploaded and one encoded per turn, by ``usage`` and by both applications' own counts."""
    encoded_before = pair.encoder.counters()["images"]
    chat_before = pair.counts()
    turns, messages, usages = 5, [], []
    for turn, image in enumerate(fresh_images(5), start=1):
        messages.append(user_turn(f"turn {turn}: what changed?", [image]))
        response = pair.chat(body(messages))
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
        messages.append({"role": "assistant", "content": "Noted."})
    got = [(u["images_sent"], u["images_uploaded"], u["images_encoded"]) for u in usages]
    assert got == [(t, 1, 1) for t in range(1, turns + 1)]
    assert [u["rows_pulled"] for u in usages] == sorted(u["rows_pulled"] for u in usages)
    # counted before each answer, exact at once: no export lag to wait out
    assert pair.encoder.counters()["images"] - encoded_before == turns
    chat_now = pair.counts()

    def moved(kind: str) -> float:
        name = "prefill_images_total"
        return chat_now.value(name, kind=kind) - chat_before.value(name, kind=kind)

    assert (moved("uploaded"), moved("encoded")) == (turns, turns)
    assert moved("sent") == sum(range(1, turns + 1))


# -- restarts and scaling -------------------------------------------------------------------------
class Load:
    """Requests sent back to back from a thread until stopped; every answer's status kept."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.statuses.append(self.send())
            except Exception:  # a transport error or a VitserveError: a failure either way
                self.statuses.append(-1)

    def wait_for(self, answers: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        target = len(self.statuses) + answers
        while len(self.statuses) < target and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.statuses) >= target, f"only {len(self.statuses)} answers"

    def finish(self) -> list[int]:
        self.stop.set()
        self.thread.join(timeout=300)
        return self.statuses


def _replicas(app_name: str, deployment: str) -> list[Any]:
    import ray

    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if deployment in a["name"] and f"{app_name}#" in a["name"]
    ]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


def _chat_load(pair: Any) -> Load:
    def send() -> int:  # a new image each time: every request needs the encoder
        return pair.chat(body([user_turn("describe", fresh_images(1))])).status_code

    return Load(send)


def test_the_encoder_restarted_or_scaled_while_prefill_serves(own_pair) -> None:
    """The encoder application's replicas killed (encoder, then ingress) and then scaled from 1
    to 2: chat requests keep being answered (the client SDK retries), none fails."""
    import ray

    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import serve_app

    load = _chat_load(own_pair)
    load.wait_for(2)
    for deployment in ("EncoderDeployment", "Ingress"):
        [replica] = _replicas(own_pair.encoder.name, deployment)
        ray.kill(replica, no_restart=True)  # Serve's controller starts a new one
        load.wait_for(3)
    scaled = own_pair.encoder.config.model_copy(
        update={"encoder": own_pair.encoder.config.encoder.model_copy(update={"num_replicas": 2})}
    )
    serve_app(
        build_application(scaled),
        name=own_pair.encoder.name,
        route_prefix=f"/{own_pair.encoder.name}",
    )
    assert len(_replicas(own_pair.encoder.name, "EncoderDeployment")) == 2
    load.wait_for(3)
    statuses = load.finish()
    serve_app(
        build_application(own_pair.encoder.config),
        name=own_pair.encoder.name,
        route_prefix=f"/{own_pair.encoder.name}",
    )
    assert statuses and set(statuses) == {200}, statuses


def test_the_prefill_restarted_or_scaled_while_the_encoder_serves(own_pair) -> None:
    """The reverse: the prefill application scaled from 1 to 2 replicas, then a replica
    killed, while clients encode through the encoder application and chat: encodes never
    fail, chats keep being answered (a caller retrying the 503 of a restart, as OpenAI's
    clients do)."""
    import ray

    from vitserve.client import EncoderClient
    from vitserve.deployments.prefill.app import build_prefill_application
    from vitserve.deployments.runner.local import serve_app

    encoder = EncoderClient(own_pair.encoder.url)

    def encode() -> int:
        encoder.encode(fresh_images(1))
        return 200

    def chat_with_retries() -> int:
        for _ in range(60):
            status = own_pair.chat(body([user_turn("describe", fresh_images(1))])).status_code
            if status not in (500, 502, 503, 504):
                return status
            time.sleep(0.5)
        return status

    encodes, chats = Load(encode), Load(chat_with_retries)
    chats.wait_for(2)
    scaled = own_pair.config.model_copy(
        update={"prefill": own_pair.config.prefill.model_copy(update={"num_replicas": 2})}
    )
    serve_app(
        build_prefill_application(scaled), name=own_pair.name, route_prefix=f"/{own_pair.name}"
    )
    assert len(_replicas(own_pair.name, "PrefillServer")) == 2
    chats.wait_for(3)
    for replica in _replicas(own_pair.name, "PrefillServer"):
        ray.kill(replica, no_restart=True)
    chats.wait_for(3)
    encodes.wait_for(3)
    encode_statuses, chat_statuses = encodes.finish(), chats.finish()
    serve_app(
        build_prefill_application(own_pair.config),
        name=own_pair.name,
        route_prefix=f"/{own_pair.name}",
    )
    encoder.close()
    assert set(encode_statuses) == {200}
    assert set(chat_statuses) == {200}, chat_statuses


# -- refusals that cost nothing else --------------------------------------------------------------
def test_too_many_images_are_refused_before_any_is_encoded(pair) -> None:
    before = pair.encoder.counters()["images"]
    allowed = pair.config.limits.max_images_per_request
    response = pair.chat(body([user_turn("many", fresh_images(allowed + 1))]))
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert (error["limit"], error["value"]) == ("max_images_per_request", allowed + 1)
    assert pair.encoder.counters()["images"] == before


def test_a_prompt_too_long_with_its_images_is_refused_before_any_is_encoded(pair) -> None:
    """The text fits the context, the text and the images' tokens (known from their headers)
    do not: 400 PromptTooLongError, and the encoder never sees the images."""
    before = pair.encoder.counters()["images"]
    images = fresh_images(8, sizes=[(320, 320)])  # 130 tokens each on the tiny Qwen2-VL
    text = "hello " * 1100  # 3,300 tokens of the 4,096 the tiny model holds
    response = pair.chat(body([user_turn(text, images)]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "PromptTooLongError" and error["tokens"] > error["allowed"]
    assert pair.encoder.counters()["images"] == before
    alone = pair.chat(body([user_turn(text, [])]))  # the text alone fits
    assert alone.status_code == 200, alone.text


def test_a_prefill_without_its_encoder_application_answers_503(deploy_prefill, pair) -> None:
    """Started before (or without) the encoder application it names: it starts, answers 503
    with Retry-After, and names the application."""
    from dataclasses import replace

    absent = replace(pair.encoder, name="no-such-encoder")
    lonely = deploy_prefill("pfs-lonely", absent, **{"prefill.num_cpus": 0.02})
    try:
        response = lonely.chat(body([user_turn("hello", [])]))
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"]
        error = response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert "no-such-encoder" in error["message"]
    finally:
        deploy_prefill.remove(lonely.name)
