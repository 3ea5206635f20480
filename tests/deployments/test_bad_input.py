"""Bad input over real HTTP against a deployed vitserve application (and its prefill
application): every class of malformed request answers a 4xx in the API's one error shape,
``{"error": {"type", "message", ...}}``, naming the problem, and the replicas keep serving.

The classes: JSON nested 5,000 deep, 0-byte bodies, wrong content types, bodies over
``max_request_bytes`` (declared, or chunked with no Content-Length), 10k-image requests (JSON
and multipart), decompression bombs (declared dimensions, PIL's own bomb error), work bombs
(a progressive JPEG of 2006 scans, stray bytes, a GIF of 70k sub-blocks), non-hex and
wrong-length keys, bad row ranges, bad query parameters, unknown routes and wrong methods.
"""

from __future__ import annotations

import base64
import json
import socket
import statistics
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.image_inputs import bad_images, crafted_png
from vitserve.testing.images import (
    gif_with_sub_blocks,
    jpeg_scan_bomb,
    jpeg_with_stray_bytes,
    make_image,
)

# main_app's limits (tests/conftest.py): 8 images, 3 MiB a request, 4 M pixels an image
OVER_BYTES = 4 * 2**20
DEEP = 5000


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    send: Callable[[httpx.Client, str, str], httpx.Response]  # (client, app url, chat url)
    status: int
    needle: str  # in the error's message (case-insensitive), or a field=value of the error
    type: str = "MalformedRequestError"


def _post(path: str, *, chat: bool = False, **kwargs: Any) -> Callable[..., httpx.Response]:
    return lambda c, app, llm: c.post(f"{llm if chat else app}{path}", **kwargs)


def _get(path: str, **kwargs: Any) -> Callable[..., httpx.Response]:
    return lambda c, app, llm: c.request(kwargs.pop("method", "GET"), f"{app}{path}", **kwargs)


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length): a JSON array of ``total`` bytes."""
    yield b'{"images": ["'
    for _ in range(total // size):
        yield b"a" * size
    yield b'"]}'


def _declared(path: str, length: int) -> Callable[..., httpx.Response]:
    """A POST declaring a ``length``-byte JSON body and sending 2 bytes of it (a raw socket:
    httpx will not send a body shorter than its Content-Length); the answer as httpx's."""

    def send(client: httpx.Client, app: str, llm: str) -> httpx.Response:
        url = httpx.URL(f"{app}{path}")
        head = (
            f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n{}"
        )
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(head.encode())
            raw = b""
            while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _length(raw):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                raw += chunk
        status_line, _, rest = raw.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        fields = [h.split(b": ", 1) for h in headers.split(b"\r\n")]
        return httpx.Response(int(status_line.split()[1]), content=body, headers=fields)

    return send


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _deep(key: str) -> bytes:
    return json.dumps({key: 0}).encode().replace(b"0", b"[" * DEEP + b"]" * DEEP)


def _multipart(n: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("images", (f"{i}.png", b"x", "image/png")) for i in range(n)]


KEY = "ab" * 32
JSON = {"content-type": "application/json"}
TEXT = {"content-type": "text/plain"}
tiny = make_image(32, 32, seed=7)
b64 = base64.b64encode(tiny).decode()
chat_text = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

CASES = [
    # deeply nested or huge JSON, 0-byte bodies, wrong content types: every JSON route
    *[
        Case(
            "json",
            f"{DEEP}-deep JSON {path}",
            _post(path, chat=chat, content=_deep(field), headers=JSON),
            422,
            "nested too deeply",
        )
        for path, field, chat in [
            ("/v1/encode", "images", False),
            ("/v1/probe", "keys", False),
            ("/v1/rows", "reads", False),
            ("/v1/chat/completions", "messages", True),
        ]
    ],
    *[
        Case(
            "json",
            f"0-byte body {path} {ctype}",
            _post(path, chat=chat, content=b"", headers=headers),
            422,
            "empty",
        )
        for path, chat, ctype, headers in [
            ("/v1/encode", False, "none", {}),
            ("/v1/encode", False, "json", JSON),
            (
                "/v1/encode",
                False,
                "multipart",
                {"content-type": "multipart/form-data; boundary=xyz"},
            ),
            ("/v1/probe", False, "json", JSON),
            ("/v1/rows", False, "none", {}),
            ("/v1/chat/completions", True, "json", JSON),
        ]
    ],
    *[
        Case(
            "json",
            f"text/plain {path}",
            _post(path, chat=chat, content=body, headers=TEXT),
            415,
            "content type",
        )
        for path, chat, body in [
            ("/v1/encode", False, b"hello"),
            ("/v1/probe", False, b'{"keys": []}'),
            ("/v1/rows", False, b'{"reads": []}'),
            ("/v1/chat/completions", True, json.dumps(chat_text).encode()),
        ]
    ],
    Case(
        "json",
        "image/png body /v1/encode",
        _post("/v1/encode", content=tiny, headers={"content-type": "image/png"}),
        415,
        "content type",
    ),
    Case(
        "json",
        "invalid JSON /v1/probe",
        _post("/v1/probe", content=b'{"keys": [', headers=JSON),
        422,
        "invalid JSON",
    ),
    *[
        Case(
            "json",
            f"chunked {OVER_BYTES >> 20} MiB {path}",
            _post(path, chat=chat, content=_chunks(OVER_BYTES), headers=JSON),
            413,
            "limit=max_request_bytes",
            "LimitExceededError",
        )
        for path, chat in [
            ("/v1/encode", False),
            ("/v1/probe", False),
            ("/v1/chat/completions", True),
        ]
    ],
    Case(
        "json",
        "declared 1 GiB /v1/rows",
        _declared("/v1/rows", 2**30),
        413,
        "limit=max_request_bytes",
        "LimitExceededError",
    ),
    # 10k-image requests, decompression bombs
    Case(
        "images",
        "10k images JSON",
        _post("/v1/encode", json={"images": [{"data": "iVBORw0KGgo="}] * 10_000}),
        413,
        "value=10000",
        "LimitExceededError",
    ),
    Case(
        "images",
        "10k images multipart",
        _post("/v1/encode", files=_multipart(10_000)),
        413,
        "limit=max_images_per_request",
        "LimitExceededError",
    ),
    Case(
        "images",
        "10k keys /v1/probe",
        _post("/v1/probe", json={"keys": [KEY] * 10_000}),
        413,
        "limit=max_keys_per_probe",
        "LimitExceededError",
    ),
    Case(
        "images",
        "10k reads /v1/rows",
        _post("/v1/rows", json={"reads": [[KEY, 0, 1]] * 10_000}),
        413,
        "limit=max_keys_per_probe",
        "LimitExceededError",
    ),
    Case(
        "images",
        "declared 5000x5000 PNG (multipart)",
        _post(
            "/v1/encode",
            files=[
                (
                    "images",
                    ("b.png", crafted_png(5000, 5000, 8, zlib.compress(b"\0" * 64)), "image/png"),
                )
            ],
        ),
        413,
        "limit=max_image_pixels",
        "ImageTooLargeError",
    ),
    Case(
        "images",
        "PIL DecompressionBombError PNG (JSON)",
        _post(
            "/v1/encode",
            json={"images": [{"data": base64.b64encode(bad_images()["bomb"]).decode()}]},
        ),
        413,
        "limit=max_image_pixels",
        "ImageTooLargeError",
    ),
    # a chat body of ~900k empty objects (2.6 MiB, under max_request_bytes): refused unparsed
    Case(
        "json",
        "chat body of 900k JSON values",
        _post(
            "/v1/chat/completions",
            chat=True,
            content=b"[" + b"{}," * 900_000 + b"{}]",
            headers=JSON,
        ),
        413,
        "limit=json_values",
        "LimitExceededError",
    ),
    # work bombs: small files whose structure makes the decode costly (vitserve.encoder.decode_work)
    *[
        Case(
            "images",
            name,
            _post("/v1/encode", files=[("images", ("w.img", data, "application/octet-stream"))]),
            413,
            f"limit={limit}",
            "ImageTooLargeError",
        )
        for name, data, limit in [
            ("JPEG of 2006 scans (49 KB)", jpeg_scan_bomb(1984, 2000), "max_jpeg_scans"),
            ("JPEG with 70k stray bytes", jpeg_with_stray_bytes(70_000), "max_structure_steps"),
            ("GIF of 70k sub-blocks", gif_with_sub_blocks(70_000), "max_structure_steps"),
        ]
    ],
    Case(
        "images",
        "multipart text field",
        _post("/v1/encode", data={"images": "x"}, files=[("other", ("a", b"x"))]),
        422,
        "images",
    ),
    # keys and ranges
    *[
        Case("keys", name, send, 422, needle)
        for name, send, needle in [
            (
                "encode key 63 hex",
                _post("/v1/encode", json={"images": [{"key": KEY[:63]}]}),
                "images[0].key",
            ),
            (
                "encode key uppercase",
                _post("/v1/encode", json={"images": [{"key": KEY.upper()}]}),
                "images[0].key",
            ),
            ("probe key non-hex", _post("/v1/probe", json={"keys": [KEY, "zz" * 32]}), "keys[1]"),
            ("probe key not a string", _post("/v1/probe", json={"keys": [7]}), "keys[0]"),
            (
                "rows key 65 hex",
                _post("/v1/rows", json={"reads": [[KEY + "a", 0, 1]]}),
                "reads[0][0]",
            ),
            ("fetch key non-hex", _get(f"/v1/embeddings/{'g' * 64}"), "64-hex"),
            ("fetch key 66 hex", _get(f"/v1/embeddings/{KEY}ab"), "64-hex"),
            ("fetch start negative", _get(f"/v1/embeddings/{KEY}?start=-1"), "negative"),
            ("fetch start > end", _get(f"/v1/embeddings/{KEY}?start=5&end=3"), "reversed"),
            ("fetch end=abc", _get(f"/v1/embeddings/{KEY}?end=abc"), "parameter=end"),
            ("fetch start=1.5", _get(f"/v1/embeddings/{KEY}?start=1.5"), "parameter=start"),
            ("rows start negative", _post("/v1/rows", json={"reads": [[KEY, -1, 2]]}), "negative"),
            ("rows start > end", _post("/v1/rows", json={"reads": [[KEY, 4, 2]]}), "reversed"),
            ("rows non-integer", _post("/v1/rows", json={"reads": [[KEY, "0", 2]]}), "integers"),
            ("rows boolean", _post("/v1/rows", json={"reads": [[KEY, False, True]]}), "integers"),
        ]
    ],
    # routes and methods
    Case("routes", "unknown route", _get("/v1/nothing"), 404, "no such route"),
    Case("routes", "GET on a POST route", _get("/v1/encode"), 405, "method not allowed"),
    Case(
        "routes",
        "DELETE on a GET route",
        _get(f"/v1/embeddings/{KEY}", method="DELETE"),
        405,
        "method not allowed",
    ),
]
GROUPS = {
    "json": "Bad input: deeply nested, huge, 0-byte or mistyped bodies",
    "images": "Bad input: 10k-image requests, decompression and decode-work bombs",
    "keys": "Bad input: non-hex or wrong-length keys, bad row ranges and query values",
    "routes": "Bad input: unknown routes and wrong methods",
}


def _names(response: httpx.Response, case: Case) -> str | None:
    """Why ``response`` is not the answer ``case`` wants (None: it is)."""
    if response.status_code != case.status:
        return f"status {response.status_code}, want {case.status}: {response.text[:300]}"
    try:
        error = response.json()["error"]
        kind, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        return f"not the error shape: {response.text[:300]}"
    if kind != case.type:
        return f"type {kind}, want {case.type}: {message}"
    field, _, value = case.needle.partition("=")
    if value and str(error.get(field)) != value:
        return f"{field}={error.get(field)!r}, want {value}: {error}"
    if not value and case.needle.lower() not in message.lower():
        return f"{case.needle!r} not in {message!r}"
    return None


@pytest.fixture(scope="module")
def chat(main_app, deploy_prefill) -> Iterator[Any]:
    app = deploy_prefill("bad-llm", main_app, **{"prefill.num_cpus": 0.02})
    yield app
    deploy_prefill.remove(app.name)


def test_every_bad_input_class_answers_a_4xx_naming_it(main_app, chat, reliability) -> None:
    """Each case of the table: its 4xx, in the error shape, naming the problem; then the
    encoder and the prefill application still answer good requests."""
    client = httpx.Client(timeout=30)
    wrong: list[str] = []
    sent: Counter[str] = Counter()
    failed: Counter[str] = Counter()  # 5xx answers
    for case in CASES:
        response = case.send(client, main_app.url, chat.url)
        sent[case.group] += 1
        failed[case.group] += response.status_code >= 500
        if (why := _names(response, case)) is not None:
            wrong.append(f"{case.name}: {why}")
    assert not wrong, "\n".join(wrong)

    good = main_app.encode([make_image(40, 40, seed=4242)])
    assert good.status_code == 200 and "num_tokens" in good.json()["items"][0], good.text
    answer = client.post(f"{chat.url}/v1/chat/completions", json={**chat_text, "temperature": 0})
    assert answer.status_code == 200, answer.text
    # sampling values at the edge of their ranges (found by the API fuzz): a temperature whose
    # division overflows, a top_p below float32's range
    for extreme in (
        {"temperature": 1e-40},
        {"top_p": 5e-324},
        {"temperature": 5e-324, "top_p": 5e-324},
    ):
        answer = client.post(f"{chat.url}/v1/chat/completions", json={**chat_text, **extreme})
        assert answer.status_code == 200, (extreme, answer.text)
    client.close()
    for group, case in GROUPS.items():
        classes = len({c.name.split(" /")[0] for c in CASES if c.group == group})
        reliability.record(
            case,
            tried=sent[group],
            failed=failed[group],
            wrong=0,
            lost=0,
            note=f"{classes} classes, each a 4xx in the error shape",
        )


def _replica(app: str) -> Any:
    """The process of ``app``'s one replica (Ray titles it ``ray::ServeReplica:<app>:...``)."""
    import psutil

    found = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(f"ServeReplica:{app}:" in part for part in p.info["cmdline"] or [])
    ]
    assert len(found) == 1, found
    return found[0]


def test_a_chat_body_of_values_is_refused_at_once_and_the_replica_stays_small(
    chat, reliability
) -> None:
    """900k empty JSON objects (2.6 MiB; parsed, ~60 MB of Python objects): 413 naming
    ``json_values`` within a second, three times, and the prefill replica's resident set,
    sampled every 5 ms, grows by less than 32 MiB (the body, its reading and the replica's
    own churn; parsed, the body takes 65 MiB of objects on top, measured by tracemalloc)."""
    replica = _replica(chat.name)
    body = b"[" + b"{}," * 900_000 + b"{}]"
    before, peak, stop = replica.memory_info().rss, [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], replica.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    seconds = []
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(3):
                started = time.perf_counter()
                answer = client.post(f"{chat.url}/v1/chat/completions", content=body, headers=JSON)
                seconds.append(time.perf_counter() - started)
                assert answer.status_code == 413, answer.text
                assert answer.json()["error"]["limit"] == "json_values"
    finally:
        stop.set()
        sampler.join()
    growth = peak[0] - before
    print(f"chat body of 900k values: {seconds} s, replica grew {growth / 2**20:.1f} MiB")
    assert statistics.median(seconds) < 1.0, seconds
    assert growth < 32 * 2**20, growth
    reliability.record(
        "Bad input: a chat body of 900k JSON values (2.6 MiB), three times",
        tried=3,
        failed=0,
        wrong=0,
        lost=0,
        note=(
            f"413 json_values in {max(seconds):.2f} s at most; the prefill replica's resident "
            f"set grew {growth / 2**20:.1f} MiB at its peak (bound: 32 MiB)"
        ),
    )


def test_scan_bombs_beside_a_normal_image_are_refused_at_once_and_cost_it_little(
    main_app, reliability
) -> None:
    """A dozen distinct 2006-scan JPEGs (each ~6 s of decode CPU were it decoded) sent from
    other clients while one client encodes new images: each bomb is a 413 naming
    ``max_jpeg_scans`` within 2 s, and the images' median latency stays within 2x of their
    median alone (measured before and after, in this run: A-B-A)."""
    bombs = [jpeg_scan_bomb(1984, 2000, seed=seed) for seed in range(12)]
    seeds = iter(range(700_000 + 1000 * (time.time_ns() % 1000), 10**9))

    def normal_latencies(count: int = 5) -> list[float]:
        out = []
        for _ in range(count):
            image = make_image(224, 224, seed=next(seeds))  # new: encoded, not a hit
            started = time.perf_counter()
            response = main_app.encode([image])
            out.append(time.perf_counter() - started)
            assert response.status_code == 200 and "num_tokens" in response.json()["items"][0]
        return out

    normal_latencies(2)  # warm
    alone = normal_latencies()
    answers: list[tuple[int, str, float]] = []

    def send(batch: list[bytes]) -> None:
        with httpx.Client(timeout=60) as client:
            for bomb in batch:
                started = time.perf_counter()
                files = [("images", ("bomb.jpg", bomb, "image/jpeg"))]
                response = client.post(f"{main_app.url}/v1/encode", files=files)
                error = response.json().get("error", {})
                answers.append(
                    (response.status_code, error.get("limit"), time.perf_counter() - started)
                )

    attackers = [threading.Thread(target=send, args=(bombs[i::4],)) for i in range(4)]
    for thread in attackers:
        thread.start()
    beside = normal_latencies()
    for thread in attackers:
        thread.join(60)
    again = normal_latencies()

    assert len(answers) == len(bombs)
    assert all(status == 413 and limit == "max_jpeg_scans" for status, limit, _ in answers), answers
    assert max(seconds for *_, seconds in answers) < 2.0, answers
    baseline = (statistics.median(alone) + statistics.median(again)) / 2
    ratio = statistics.median(beside) / baseline
    assert ratio <= 2.0, (ratio, alone, beside, again)
    reliability.record(
        "Bad input: 12 distinct 2006-scan JPEGs (49 KB each) beside a client encoding new images",
        tried=len(answers),
        failed=sum(status >= 500 for status, *_ in answers),
        wrong=0,
        lost=0,
        note=(
            f"each a 413 max_jpeg_scans, in {max(s for *_, s in answers):.2f} s at most; the "
            f"other client's median latency {ratio:.2f}x its median alone (A-B-A, bound 2x)"
        ),
    )


def test_the_error_handlers_give_every_error_the_shape() -> None:
    """``install_error_handlers`` on a bare FastAPI app (no Ray): validation errors, unknown
    routes, wrong methods and an unexpected exception, each in the error shape."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vitserve.deployments.common.responses import install_error_handlers
    from vitserve.errors import CacheMissError

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/items/{key}")
    async def item(key: str, end: int | None = None) -> dict[str, Any]:
        if key == "bug":
            raise RuntimeError("a bug")
        if key == "gone":
            raise CacheMissError([key])
        return {"key": key, "end": end}

    with TestClient(app, raise_server_exceptions=False) as client:
        answers = {
            "end=abc": client.get("/items/a?end=abc"),
            "unknown": client.get("/nothing"),
            "method": client.post("/items/a"),
            "bug": client.get("/items/bug"),
            "raised": client.get("/items/gone"),
        }
        assert client.get("/items/a?end=3").json() == {"key": "a", "end": 3}
    want = {
        "end=abc": (422, "MalformedRequestError"),
        "unknown": (404, "MalformedRequestError"),
        "method": (405, "MalformedRequestError"),
        "bug": (500, "InternalError"),
        "raised": (404, "CacheMissError"),
    }
    for name, response in answers.items():
        error = response.json()["error"]
        assert (response.status_code, error["type"]) == want[name], (name, response.text)
    assert answers["end=abc"].json()["error"]["parameter"] == "end"
    assert "query parameter 'end'" in answers["end=abc"].json()["error"]["message"]
    assert answers["method"].headers["allow"] == "GET"
    assert "RuntimeError" in answers["bug"].json()["error"]["message"]
