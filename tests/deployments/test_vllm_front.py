"""The vLLM front (``vitserve.deployments.vllm.app``) in front of fake vLLM servers.

Two fake upstreams stand in for vLLM OpenAI servers: real HTTP servers on loopback that record
every request they receive and answer as vLLM does (JSON, SSE, its 400/404 error bodies, its
model list). The front is deployed once for the module beside the session's encoder
application (``main_app``, tiny Qwen2-VL), reaching it by its handle: what it forwards is read
back from the fakes, its images' keys checked against the SDK's own. The real-vLLM tests are
``tests/vllm/``.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from vitserve.testing.images import make_image

FRONT = "t-vllm-front"
UPSTREAM_KEY = "sk-upstream-secret"  # the front's vllm.api_key
MAX_IMAGES = 4  # the front's limits.max_images_per_request (the encoder's is 8)
RETRY_AFTER = 7  # the front's vllm.retry_after_s
CHECK_S = 0.3  # the front's vllm.check_s: how often it reads each fake's /metrics
GATE_TIMEOUT_S = 60  # how long the gated stream waits for the test before going on anyway
MODELS = {
    "object": "list",
    "data": [
        {
            "id": "fake-vlm",
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "max_model_len": 4096,
        }
    ],
}
ERRORS = {  # the body's "model" -> vLLM's error answer
    "missing": (
        404,
        {
            "error": {
                "message": "The model `missing` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        },
    ),
    "bad": (
        400,
        {
            "error": {
                "message": "max_tokens must be at least 1, got 0.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
    ),
}
_seed = iter(range(910_000, 10**9))
_arrival = itertools.count()  # the order requests reached the fakes, across both


def fresh_images(n: int) -> list[bytes]:
    """Images no other request of the session sent (new seeds)."""
    return [make_image(64 + 8 * (k % 3), 48, seed=next(_seed)) for k in range(n)]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def sse_events(name: str) -> list[bytes]:
    """The events a fake streams (each one chunk on the wire)."""
    chunks = [
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "fake-vlm",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        for delta, finish in (
            ({"role": "assistant", "content": ""}, None),
            ({"content": f"from {name}"}, None),
            ({"content": " é✓"}, None),
            ({}, "stop"),
        )
    ]
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


# -- the fake vLLM servers ----------------------------------------------------------------------
@dataclass
class Seen:
    """One request a fake received (``seq``: its place in the order of arrival at either)."""

    seq: int
    upstream: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # no pooled connection outlives a stop
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _record(self) -> Seen:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        fake = self.server.fake
        headers = {k.lower(): v for k, v in self.headers.items()}
        seen = Seen(next(_arrival), fake.name, self.command, self.path, headers, body)
        fake.seen.append(seen)
        return seen

    def do_GET(self) -> None:
        self._record()
        if self.path == "/v1/models":
            self._answer(200, MODELS)
        elif self.path == "/metrics":  # vLLM's, with its connector's counters when it has one
            lines = ['vllm:num_requests_running{engine="0"} 0.0']
            if self.server.fake.connector:  # type: ignore[attr-defined]
                lines.append('vllm:vitserve_ec_loads_total{engine="0"} 0.0')
            body = "\n".join(lines).encode() + b"\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        fake = self.server.fake
        doc = self._record().json()
        if doc.get("model") in ERRORS:
            self._answer(*ERRORS[doc["model"]])
        elif doc.get("stream"):
            self._stream(fake, gated=doc.get("model") == "gated")
        else:
            self._answer(
                200,
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "fake-vlm",
                    "upstream": fake.name,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hi"},
                        }
                    ],
                    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
                },
            )

    def _stream(self, fake: FakeVllm, gated: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        for i, event in enumerate(sse_events(fake.name)):
            if gated and i == 1:  # the rest only once the test has the first event
                fake.released.append(fake.gate.wait(GATE_TIMEOUT_S))
            self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True


@dataclass
class FakeVllm:
    """A stand-in for one vLLM OpenAI server on loopback; ``stop()`` makes it refuse
    connections, ``start()`` serves again on the same port."""

    name: str
    gate: threading.Event
    seen: list[Seen] = field(default_factory=list)
    released: list[bool] = field(default_factory=list)  # per gated stream: the gate opened
    port: int = 0
    server: ThreadingHTTPServer | None = None
    connector: bool = True  # its /metrics shows vitserve's connector

    def start(self) -> FakeVllm:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), _Handler)  # bound here
        self.server.daemon_threads = True
        self.server.fake = self  # type: ignore[attr-defined]
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chats(self) -> list[Seen]:
        return [s for s in self.seen if s.path == "/v1/chat/completions"]


@dataclass
class Front:
    url: str  # the front's base: {url}/v1/chat/completions
    encoder: Any  # the encoder application (conftest's App)
    fakes: list[FakeVllm]
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def chat(self, body: dict[str, Any], **kw: Any) -> httpx.Response:
        return self.client.post(f"{self.url}/v1/chat/completions", json=body, **kw)

    def sent(self) -> int:
        return sum(len(f.chats()) for f in self.fakes)

    def last_forwarded(self) -> Seen:
        """The last chat request that reached a fake."""
        return max((s for f in self.fakes for s in f.chats()), key=lambda s: s.seq)


@pytest.fixture(scope="module")
def front(main_app, serve_url) -> Iterator[Front]:
    from ray import serve

    from tests.conftest import STOP_POLL_S
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.runner.local import serve_app
    from vitserve.deployments.vllm.app import build_vllm_application

    gate = threading.Event()
    fakes = [FakeVllm("a", gate).start(), FakeVllm("b", gate).start()]
    section = {
        "urls": [f.url + "/" for f in fakes],
        "encoder_app": main_app.name,
        "route_prefix": f"/{FRONT}",
        "num_cpus": 0.05,
        "api_key": UPSTREAM_KEY,
        "retry_after_s": RETRY_AFTER,
        "encoder_attempts": 3,
        "overlap": True,  # forced: a CPU encoder's default is off (overlaps)
        "check_s": CHECK_S,
        "graceful_shutdown_wait_loop_s": STOP_POLL_S,
    }
    cfg = VitserveConfig.load(
        {
            **main_app.config.model_dump(),
            "vllm": section,
            "limits.max_images_per_request": MAX_IMAGES,
        }
    )
    assert cfg.vllm.urls == [f.url for f in fakes]  # the trailing slash stripped
    serve_app(build_vllm_application(cfg), name=FRONT, route_prefix=f"/{FRONT}")
    yield Front(f"{serve_url}/{FRONT}", main_app, fakes)
    serve.delete(FRONT)
    gate.set()
    for fake in fakes:
        fake.stop()


def chat(front: Front, content: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    """A chat of one user message, as a caller with a token of its own (auth is off)."""
    body = {"model": "fake-vlm", "messages": [{"role": "user", "content": content}], **extra}
    return front.chat(body, headers={"Authorization": "Bearer caller-token"})


def counts(response: httpx.Response) -> tuple[int, int, int]:
    return tuple(int(response.headers[f"x-vitserve-{k}"]) for k in ("images", "uploaded", "cached"))


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def keys_of(front: Front, images: list[bytes]) -> list[str]:
    """Each image's vitserve key, as the SDK computes it, once the store holds it (the front
    hands vLLM a chat once its images are claimed; their records follow)."""
    from vitserve.client import EncoderClient

    with EncoderClient(front.encoder.url) as client:
        client.describe()
        keys = client.core.keys_of(images)
        deadline = time.monotonic() + 30
        while None in client.probe(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert None not in client.probe(keys)  # the front's request stored them under these keys
    return keys


def encoder_store(front: Front) -> Any:
    """The encoder application's store, as its ingress opens it (this process is a Ray
    driver: a node store is reachable)."""
    from vitserve.cache import open_store
    from vitserve.client import EncoderClient

    cfg = front.encoder.config
    with EncoderClient(front.encoder.url) as client:
        fingerprint = client.describe()["fingerprint"]
    return open_store(cfg.store, namespace=cfg.namespace, fingerprint=fingerprint)


def test_overlap_is_on_by_default_where_the_encoder_has_gpus_of_its_own() -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.vllm.app import overlaps

    def cfg(**kw: object) -> VitserveConfig:
        return VitserveConfig.load({"model": "demo", **kw})

    assert not overlaps(cfg())  # a CPU encoder shares the cores with vLLM
    assert not overlaps(cfg(device="cpu"))
    assert overlaps(cfg(device="cuda")) and overlaps(cfg(**{"encoder.num_gpus": 0.5}))
    assert overlaps(cfg(**{"vllm.overlap": True})) and not overlaps(
        cfg(device="cuda", **{"vllm.overlap": False})
    )


def test_a_chat_goes_to_vllm_once_its_images_are_claimed(front) -> None:
    """``vllm.overlap`` (forced on here): the front forwards the chat as soon as the service has
    claimed its new images, not once they are encoded: an image whose claim another holds (an
    encoder elsewhere encoding it) does not hold the chat back. Its record comes once that
    claim ends (the service's encoder takes it over): vLLM's connector waits for it."""
    from vitserve.cache.base import Pending

    [image] = fresh_images(1)
    store = encoder_store(front)
    [key] = front_keys(front, [image])
    assert store.claim(key, 60, "an-encoder-elsewhere")
    try:
        response = chat(front, [image_part(data_url(image))])
        assert response.status_code == 200, response.text
        assert counts(response) == (1, 1, 0)
        uuid = front.last_forwarded().json()["messages"][0]["content"][0]["uuid"]
        assert uuid == f"{front.encoder.config.namespace}/{key}"
        assert store.lookup_states([key]) == [Pending.CLAIMED]  # forwarded before its record
    finally:
        store.release(key, "an-encoder-elsewhere")
    deadline = time.monotonic() + 30  # taken over and published by the service's encoder
    while store.headers_many([key]) == [None] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.headers_many([key]) != [None]
    store.close()


def front_keys(front: Front, images: list[bytes]) -> list[str]:
    """The keys the service gives ``images`` (nothing encoded)."""
    from vitserve.client import EncoderClient

    with EncoderClient(front.encoder.url) as client:
        client.describe()
        return client.core.keys_of(images)


# -- what is forwarded ----------------------------------------------------------------------------
def test_data_url_images_are_forwarded_named_by_their_vitserve_keys(front) -> None:
    """Each data-URL image part gets ``uuid`` = ``<namespace>/<key>`` (a repeat the same), its
    URL kept; text and every other field pass unchanged; the caller's Authorization is
    replaced by the configured api_key."""
    a, b = fresh_images(2)
    content = [
        {"type": "text", "text": "compare"},
        image_part(data_url(a)),
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": data_url(b), "detail": "low"}},
        image_part(data_url(a)),
    ]
    extra = {"max_tokens": 7, "temperature": 0.5, "vendor_field": {"x": [1, 2]}}
    response = chat(front, content, **extra)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    assert counts(response) == (3, 2, 0)  # 3 image parts; 2 distinct new images uploaded
    assert response.headers["x-vitserve-unkeyed"] == "0"
    seen = front.last_forwarded()
    key_a, key_b = keys_of(front, [a, b])
    expected = copy.deepcopy(
        {"model": "fake-vlm", "messages": [{"role": "user", "content": content}], **extra}
    )
    parts = expected["messages"][0]["content"]
    namespace = front.encoder.config.namespace  # the key, qualified by its namespace
    assert namespace
    for i, key in ((1, key_a), (3, key_b), (4, key_a)):
        parts[i]["uuid"] = f"{namespace}/{key}"
    assert seen.json() == expected
    assert seen.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert seen.headers["content-type"] == "application/json"

    again = chat(front, [image_part(data_url(a)), {"type": "text", "text": "again"}])
    assert again.status_code == 200, again.text
    assert counts(again) == (1, 0, 1)  # the store had it: nothing uploaded
    assert front.last_forwarded().json()["messages"][0]["content"][0]["uuid"] == parts[1]["uuid"]


def test_a_remote_image_url_is_refused_by_default_naming_what_to_send(front) -> None:
    """An image part whose URL is not a data: URL (vitserve could not key it; vLLM would fetch
    and encode it itself, unkeyed): 422 by default (``vllm.remote_media: refuse``), naming the
    part and both ways out; nothing is encoded or forwarded."""
    [image] = fresh_images(1)
    sent, encoded = front.sent(), front.encoder.counters()["images"]
    response = chat(front, [image_part(data_url(image)), image_part("https://example.com/cat.png")])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "MalformedRequestError"
    assert error["message"].startswith("image part 1: a URL that is not a data: URL")
    assert "vllm.remote_media=forward" in error["message"]
    # vitserve's errors have vLLM's (OpenAI's) shape, with vitserve's fields beside
    vllms = ERRORS["missing"][1]["error"]
    assert set(vllms) <= set(error) and (error["code"], error["param"]) == (422, None)
    assert front.sent() == sent and front.encoder.counters()["images"] == encoded


def test_with_remote_media_forward_a_remote_image_goes_to_vllm_unkeyed_and_counted() -> None:
    """``vllm.remote_media: forward``: a remote URL's part goes to vLLM as it came, without a
    uuid, counted in ``x-vitserve-unkeyed`` (the front's own prepare step, without Serve)."""
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.vllm.app import VllmFront

    def front_with(policy: str) -> Any:
        cfg = VitserveConfig.load(
            {"vllm.urls": ["http://127.0.0.1:1"], "vllm.remote_media": policy}
        )
        front = object.__new__(VllmFront.func_or_class)  # _prepare reads only its config here
        front.cfg = cfg
        return front

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [image_part("https://example.com/cat.png")]}],
    }
    raw = bytearray(json.dumps(body).encode())
    prepared = front_with("forward")._prepare(raw, None, None)
    assert prepared.content == bytes(raw)  # as it came: no uuid
    assert prepared.headers()["x-vitserve-unkeyed"] == "1"
    assert prepared.headers()["x-vitserve-images"] == "1"
    from vitserve.errors import MalformedRequestError

    with pytest.raises(MalformedRequestError, match="image part 0"):
        front_with("refuse")._prepare(raw, None, None)
    assert VitserveConfig.load({}).vllm.remote_media == "refuse"


def test_a_request_without_images_is_forwarded_byte_for_byte(front) -> None:
    raw = b'{"model": "fake-vlm",  "messages": [{"role": "user", "content": "hi \\u00e9"}]}'
    response = front.client.post(
        f"{front.url}/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json", "X-Request-Id": "req-1"},
    )
    assert response.status_code == 200, response.text
    assert counts(response) == (0, 0, 0)
    seen = front.last_forwarded()
    assert seen.body == raw and seen.headers["x-request-id"] == "req-1"


def test_requests_alternate_between_the_vllm_servers(front) -> None:
    before = [len(f.chats()) for f in front.fakes]
    answered_by = []
    for _ in range(4):
        response = chat(front, [{"type": "text", "text": "hello"}])
        assert response.status_code == 200, response.text
        answered_by.append(response.json()["upstream"])
    assert [len(f.chats()) - n for f, n in zip(front.fakes, before, strict=True)] == [2, 2]
    assert answered_by[0] != answered_by[1] and answered_by[:2] == answered_by[2:]


# -- what comes back ------------------------------------------------------------------------------
def test_a_stream_is_relayed_chunk_by_chunk_byte_for_byte(front) -> None:
    """The first event reaches the caller while the fake still holds back the rest (it waits
    for the test); the whole stream arrives byte-identical, with the counts."""
    [image] = fresh_images(1)
    body = {
        "model": "gated",
        "stream": True,
        "messages": [{"role": "user", "content": [image_part(data_url(image))]}],
    }
    front.fakes[0].gate.clear()
    received = b""
    with front.client.stream("POST", f"{front.url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert counts(response) == (1, 1, 0)
        for chunk in response.iter_raw():
            received += chunk
            if not front.fakes[0].gate.is_set() and received.endswith(b"\n\n"):
                front.fakes[0].gate.set()  # the first event is here: let the fake go on
    name = front.last_forwarded().upstream
    assert received == b"".join(sse_events(name))
    assert [f.released[-1] for f in front.fakes if f.name == name] == [True]  # not timed out


def test_the_openai_client_streams_through_the_front(front) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="caller-token", max_retries=0)
    [image] = fresh_images(1)
    stream = client.chat.completions.create(
        model="fake-vlm",
        stream=True,
        messages=[{"role": "user", "content": [image_part(data_url(image))]}],
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text in ("from a é✓", "from b é✓")
    assert [m.id for m in client.models.list()] == ["fake-vlm"]


@pytest.mark.parametrize("model", sorted(ERRORS))
def test_vllm_error_answers_keep_their_status_and_body(front, model) -> None:
    response = chat(
        front,
        [{"type": "text", "text": "hi"}],
        max_tokens=0 if model == "bad" else 1,
        **{"model": model},
    )
    status, doc = ERRORS[model]
    assert response.status_code == status
    assert response.content == json.dumps(doc).encode()
    assert counts(response) == (0, 0, 0)


def test_v1_models_passes_through(front) -> None:
    response = front.client.get(f"{front.url}/v1/models")
    assert response.status_code == 200
    assert response.json() == MODELS
    assert all(
        s.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}"
        for f in front.fakes
        for s in f.seen
        if s.path == "/v1/models"
    )


def test_a_vllm_server_down_is_passed_over_then_503_with_retry_after(front) -> None:
    a, b = front.fakes
    try:
        a.stop()
        before = len(b.chats())
        for _ in range(3):  # whichever is in turn: b answers
            response = chat(front, [{"type": "text", "text": "hello"}])
            assert response.status_code == 200, response.text
            assert response.json()["upstream"] == "b"
        assert len(b.chats()) - before == 3
        b.stop()
        sent = front.sent()
        for response in (
            chat(front, [{"type": "text", "text": "hello"}]),
            front.client.get(f"{front.url}/v1/models"),
        ):
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == str(RETRY_AFTER)
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError"
            # each named by its index in vllm.urls, never by its address
            assert "server 0" in error["message"] and "server 1" in error["message"]
            assert str(a.port) not in response.text and str(b.port) not in response.text
        assert front.sent() == sent
    finally:
        a.start()
        b.start()
    assert chat(front, [{"type": "text", "text": "back"}]).status_code == 200


# -- refused before anything is forwarded -------------------------------------------------------
def test_images_that_fail_are_refused_in_vitserves_shape_and_nothing_is_forwarded(front) -> None:
    [good] = fresh_images(1)
    sent = front.sent()
    corrupt = data_url(b"\x89PNG\r\n\x1a\n this is not an image")
    response = chat(
        front,
        [
            image_part(data_url(good)),
            image_part(data_url(good)),
            {"type": "text", "text": "and"},
            image_part(corrupt),
        ],
    )
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "ImageDecodeError"
    assert error["index"] == 2 and error["message"].startswith("image 2:")  # among image parts

    not_base64 = chat(front, [image_part("data:image/png;base64,@@@not base64@@@")])
    assert not_base64.status_code == 422
    assert not_base64.json()["error"]["type"] == "MalformedRequestError"
    assert "image 0" in not_base64.json()["error"]["message"]

    too_many = chat(front, [image_part(data_url(good))] * (MAX_IMAGES + 1))
    assert too_many.status_code == 413
    error = too_many.json()["error"]
    assert error["type"] == "LimitExceededError" and error["limit"] == "max_images_per_request"
    assert (error["value"], error["allowed"]) == (MAX_IMAGES + 1, MAX_IMAGES)

    not_json = front.client.post(
        f"{front.url}/v1/chat/completions",
        content=b"{nope",
        headers={"Content-Type": "application/json"},
    )
    assert not_json.status_code == 422 and "error" in not_json.json()
    recolored = chat(  # its own compositing: vitserve's rows (on white) would not be its
        front,
        [image_part(data_url(good))],
        media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}},
    )
    assert recolored.status_code == 422, recolored.text
    assert "rgba_background_color" in recolored.json()["error"]["message"]
    neutral = chat(  # the defaults, spelled out: forwarded
        front,
        [image_part(data_url(good))],
        media_io_kwargs={"image": {"rgba_background_color": [255, 255, 255]}},
    )
    assert neutral.status_code == 200, neutral.text
    sent += 1
    values = front.client.post(  # ~900k values, under the byte limit: refused unparsed
        f"{front.url}/v1/chat/completions",
        content=b"[" + b"{}," * 900_000 + b"{}]",
        headers={"Content-Type": "application/json"},
    )
    assert values.status_code == 413, values.text
    assert values.json()["error"]["limit"] == "json_values"
    assert front.sent() == sent


def test_the_counts_reach_metrics(front) -> None:
    from tests.conftest import App

    page = App(FRONT, front.url, None)
    before = page.page()
    new, held = fresh_images(2)
    assert chat(front, [image_part(data_url(held))]).status_code == 200
    keys_of(front, [held])  # published (the chat went on at its claim)
    response = chat(front, [image_part(data_url(i)) for i in (new, held, new)])
    assert counts(response) == (3, 1, 1)
    want = {
        kind: before("vitserve_vllm_front_images_total", kind=kind) + n
        for kind, n in (("sent", 4), ("uploaded", 2), ("cached", 1))
    }
    after = page.wait_page(
        lambda value: all(
            value("vitserve_vllm_front_images_total", kind=k) >= v for k, v in want.items()
        )
    )
    for kind, value in want.items():
        assert after("vitserve_vllm_front_images_total", kind=kind) >= value, kind
    assert after("vitserve_requests_total", route="vllm_chat", status="200") >= 2


def test_healthz(front) -> None:
    health = front.client.get(f"{front.url}/healthz").json()
    assert health == {  # how many servers, not where: no internal address in an answer
        "status": "ok",
        "servers": len(front.fakes),
        "backends": ["connected"] * len(front.fakes),
        "encoder": f"app {front.encoder.name}",
    }


def test_a_vllm_without_the_connector_is_passed_over_and_with_none_chats_are_refused(
    front,
) -> None:
    """A vLLM server whose /metrics shows no vitserve connector (restarted without
    ``--ec-transfer-config``) takes no chat once the front has read it (within ``check_s``,
    beside the chats; /healthz waits for the read): the other one takes them all; with
    neither, /healthz says so (503) and a chat is refused with a clear error before its images
    are encoded or anything is forwarded."""
    a, b = front.fakes
    try:
        b.connector = False
        time.sleep(CHECK_S * 1.5)
        front.client.get(f"{front.url}/healthz")  # the due reads, waited for
        before = len(b.chats())
        for _ in range(3):
            response = chat(front, [{"type": "text", "text": "hello"}])
            assert response.status_code == 200 and response.json()["upstream"] == "a"
        assert len(b.chats()) == before
        health = front.client.get(f"{front.url}/healthz")
        assert health.status_code == 200
        assert health.json()["backends"] == ["connected", "no_connector"]
        a.connector = False
        time.sleep(CHECK_S * 1.5)
        front.client.get(f"{front.url}/healthz")
        sent, uploads = front.sent(), front.encoder.counters()["images"]
        [image] = fresh_images(1)
        refused = chat(front, [image_part(data_url(image)), {"type": "text", "text": "?"}])
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert "without vitserve's connector" in error["message"]
        assert "--ec-transfer-config" in error["message"]
        assert front.sent() == sent and front.encoder.counters()["images"] == uploads
        health = front.client.get(f"{front.url}/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "no_connector"
        assert health.json()["backends"] == ["no_connector", "no_connector"]
        assert str(a.port) not in health.text and str(b.port) not in health.text
    finally:
        a.connector = b.connector = True
    time.sleep(CHECK_S * 1.5)
    assert chat(front, [{"type": "text", "text": "back"}]).status_code == 200


# -- without Ray ---------------------------------------------------------------------------------
def test_upstream_headers_never_carry_the_callers_authorization() -> None:
    from vitserve.deployments.vllm.app import upstream_headers

    incoming = httpx.Headers(
        {
            "Authorization": "Bearer caller",
            "Accept": "text/event-stream",
            "X-Request-Id": "r1",
            "Cookie": "c=1",
        }
    )
    assert upstream_headers(incoming, None) == {
        "content-type": "application/json",
        "accept-encoding": "identity",
        "accept": "text/event-stream",
        "x-request-id": "r1",
    }
    assert upstream_headers(incoming, "sk-1")["authorization"] == "Bearer sk-1"


def test_serve_takes_vllm_urls_by_flag_set_or_environment(monkeypatch) -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.runner import cli
    from vitserve.deployments.runner.local import local_config

    def urls(*argv: str) -> list[str]:
        return local_config(cli._overrides(cli.build_parser().parse_args(argv))).vllm.urls

    assert urls("serve") == []
    lines = cli.serving_lines(VitserveConfig.load(environ={}), "http://h:1", prefill=False)
    assert len(lines) == 1  # no front, no line for it
    assert urls("serve", "--vllm-url", "http://a:8000/", "--vllm-url", "https://b:9000") == [
        "http://a:8000",
        "https://b:9000",
    ]
    assert urls("serve", "--set", 'vllm.urls=["http://c","http://d"]') == ["http://c", "http://d"]
    monkeypatch.setenv("VITSERVE_VLLM__URLS", "http://e:1,http://f:2")
    cfg = local_config({})
    assert cfg.vllm.urls == ["http://e:1", "http://f:2"]
    assert cli.serving_lines(cfg, "http://h:1", prefill=False)[-1] == (
        "vLLM front (OpenAI API) at http://h:1/vllm/v1/chat/completions, forwarding to "
        "http://e:1, http://f:2 (docs: http://h:1/vllm/docs)"
    )
    secret = local_config({"vllm.urls": ["http://proxy:s3cret-pw@g:8000"]})
    printed = "\n".join(cli.serving_lines(secret, "http://h:1", prefill=False))
    assert "s3cret-pw" not in printed and "http://proxy:***@g:8000" in printed


def test_vllm_urls_are_checked() -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.vllm.app import build_vllm_application
    from vitserve.errors import ConfigError

    for bad in ("ftp://a", "a:8000", "http://a:port", "http://a?x=1"):
        with pytest.raises(ConfigError, match=r"vllm\.urls"):
            VitserveConfig.load({"vllm.urls": [bad]}, environ={})
    with pytest.raises(ConfigError, match=r"vllm\.urls"):
        build_vllm_application(VitserveConfig.load(environ={}))


def test_video_parts_are_items_and_the_wrong_kind_is_refused() -> None:
    from tests.encoder.test_video import clip
    from vitserve.client.ec_plan import video_option_problem
    from vitserve.deployments.vllm.app import request_images
    from vitserve.errors import MalformedRequestError

    video, image = clip(8), make_image(32, 32)

    def url(data: bytes, kind: str) -> str:
        return f"data:{kind};base64," + base64.b64encode(data).decode()

    def chat(*parts: dict) -> dict:
        return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}

    parts = (
        {"type": "image_url", "image_url": {"url": url(image, "image/png")}},
        {"type": "video_url", "video_url": {"url": url(video, "video/mp4")}},
        {"video_url": url(video, "video/mp4")},  # the short form
    )
    count, items = request_images(chat(*parts), 8)
    assert count == 3 and [i.data for i in items] == [image, video, video]
    with pytest.raises(MalformedRequestError, match="a video part holds an image"):
        request_images(chat({"type": "video_url", "video_url": {"url": url(image, "x/y")}}), 8)
    with pytest.raises(MalformedRequestError, match="send it in a video_url part"):
        request_images(chat({"type": "image_url", "image_url": {"url": url(video, "x/y")}}), 8)
    assert video_option_problem({"media_io_kwargs": {"video": {"num_frames": 8}}})
    assert video_option_problem({"mm_processor_kwargs": {"fps": 1}})
    assert video_option_problem({"media_io_kwargs": {"image": {}}}) is None


def test_a_video_is_keyed_for_vllm_under_the_settings_the_service_describes() -> None:
    """The front keys a video under the service's ``video_for.vllm`` settings (vLLM's loader's
    over the checkpoint's: a checkpoint sampling at 1 fps still gets vLLM's 2 fps), so the
    SDK's key is the service's; a service that describes no such way (one that predates
    ``video_for``, or a model whose vLLM sampling vitserve does not know) has its videos sent
    unkeyed (None), and asking the SDK for that way is a ConfigError naming it."""
    from vitserve.client.core import ClientCore
    from vitserve.encoder.video import VideoSampling
    from vitserve.errors import ConfigError
    from vitserve.families import family_spec
    from vitserve.keys import item_key, video_settings
    from vitserve.media import VideoFor

    spec = family_spec("qwen3_vl")
    ckpt = VideoSampling.from_config(spec.video or {}, {"fps": 1.0})
    ways = {"model": ckpt.settings(), "vllm": ckpt.replaced(spec.vllm_video or {}).settings()}
    assert ways["vllm"]["fps"] == 2.0 and ways["model"]["fps"] == 1.0
    model = {"fingerprint": "f" * 64, "family": "qwen3_vl", "video": ways["model"]}
    assert video_settings(model, VideoFor.MODEL) == ways["model"]
    assert video_settings(model, VideoFor.VLLM) is None  # a service before video_for
    model["video_for"] = ways
    assert video_settings(model, VideoFor.VLLM) == ways["vllm"]
    core = ClientCore.for_client("http://unused:1", None, None, None)
    core.model = model
    video = b"\x00\x00\x00\x18ftypmp42" + bytes(64)
    [key] = core.keys_of([video], VideoFor.VLLM)
    assert key == item_key(video, model["fingerprint"], "", ways["vllm"])
    assert key != core.keys_of([video])[0]
    model["video_for"] = {"model": ways["model"], "vllm": None}
    with pytest.raises(ConfigError, match="video_for=vllm"):
        core.keys_of([video], VideoFor.VLLM)
    image = b"\x89PNG\r\n\x1a\n" + bytes(32)
    assert core.keys_of([image], VideoFor.VLLM) == core.keys_of([image])  # images: any way
    model.update(video=None, video_for={"model": None, "vllm": None})  # a model without video
    assert core.keys_of([video], VideoFor.VLLM) == [item_key(video, model["fingerprint"])]
