"""Tenant isolation over every route (issue 28, "secure by default"): zero reads, zero membership
answers, zero cache hits across tenants.

One encoder application with auth on and two tenants, alice (A) and bob (B), over a private
Redis (the store of the application, with one ACL reader user per tenant: ``auth.redis_readers``,
what the SDK's direct-store path reads with), a prefill application beside it and a vLLM front
before a fake vLLM server that records what it receives. Alice stores images through every way
in: ``/v1/encode`` (multipart and JSON), the ingress's handle (the SDK's handle transport), the
SDK (HTTP) and the prefill chat with inline images. Then bob, with his own token, knowing each
of alice's keys exactly as alice got them (keys are content hashes: anyone holding the image and
the namespace computes them), tries them on every route:

* **encode** (multipart, JSON, handle, SDK over both transports, the chat, the vLLM front):
  alice's images are encoded again, in bob's namespace (``cached: false``, bob's own key, the
  encoder's image count up by one per image: zero cache hits across tenants), also when both
  send the same new image at the same moment (no single flight across tenants);
* **probe** (``/v1/probe`` with and without ``headers``, the handle, the SDK with and without a
  direct store), **embeddings** (whole and a row range), **rows** (``/v1/rows``, the handle),
  a key-only encode item, the SDK's fetch of alice's handle, the chat with
  ``vitserve://<alice's key>``: each answers a miss, and the very answer a key never stored
  gets (status, content type and body, the key itself aside): no membership oracle;
* the **direct store**: bob's Redis reader, in his namespace, misses alice's keys, and opened on
  alice's namespace is refused by Redis (NOPERM) whatever key it asks for;
* the **vLLM front**: bob's image parts reach vLLM named by bob's keys only, never by a key of
  alice's that bob wrote into the request (vLLM keys its processor cache, its encoder cache and
  vitserve's connector by that name).

Each group records one reliability row: *wrong answers* counts cross-tenant reads, hits and
membership answers (must be 0), *requests failed* the 5xx answers, *data lost* alice's entries
missing afterwards.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.blocking import Blocking
from tests.conftest import App, ChatApp
from tests.redis_process import RedisServer
from tests.reliability_table import Tally
from vitserve.cache.codec import unpack_records
from vitserve.client import AsyncEncoderClient, EncoderClient, ImageHandle
from vitserve.errors import CacheMissError, StoreError, VitserveError
from vitserve.keys import content_key
from vitserve.testing.images import make_image

ALICE = "xt-alice-token-0123456789abcdef"
BOB = "xt-bob-token-fedcba9876543210xy"
TOKENS = [{"tenant": "alice", "token": ALICE}, {"tenant": "bob", "token": BOB}]
TOKEN = {"alice": ALICE, "bob": BOB}
APP, CHAT, FRONT = "xtenant", "xtenant-llm", "xtenant-vllm"
#: the ways bob sends images to encode; alice stores one image per way and origin
BOB_ENCODES = ("http-multipart", "http-json", "handle", "sdk-http", "sdk-handle-store", "chat")
#: the ways alice stores her images
ORIGINS = ("http-multipart", "http-json", "handle", "sdk-http", "chat")
_seed = iter(range(28_280_000, 10**9))


def fresh_image() -> bytes:
    """A 64x48 PNG no other request of the session sent (every image here has this size, so
    every encode answer has the same shape: answers differ only in their keys)."""
    return make_image(64, 48, seed=next(_seed))


def data_url(image: bytes, scheme: str = "data") -> str:
    return f"{scheme}:image/png;base64," + base64.b64encode(image).decode()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def normalized(text: str, key: str) -> str:
    """An answer's text with the key it names (whole, or its first 16 characters) as KEY."""
    return re.sub(f"{key}|{key[:16]}", "KEY", text)


# -- the fake vLLM server the front forwards to ---------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen.append(json.loads(body))
        answer = json.dumps({"object": "chat.completion", "choices": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(answer)
        self.close_connection = True


class FakeVllm:
    """A loopback HTTP server standing in for vLLM: it records every chat body it receives."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
        self.server.daemon_threads = True
        self.server.seen = []  # type: ignore[attr-defined]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def seen(self) -> list[dict[str, Any]]:
        return self.server.seen  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- the two tenants and alice's entries --------------------------------------------------------
@dataclass
class Tenants:
    app: App
    chat: ChatApp
    front_url: str
    fake: FakeVllm
    redis: RedisServer
    fingerprint: str
    namespace: dict[str, str]  # tenant -> namespace
    reader: dict[str, str]  # tenant -> the store URL of the tenant's Redis reader user
    #: alice's images by origin: one per way bob encodes (BOB_ENCODES order), then one for
    #: the vLLM front
    images: dict[str, list[bytes]] = field(default_factory=dict)
    #: alice's encode items (as the API describes them) by key
    items: dict[str, dict[str, Any]] = field(default_factory=dict)
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def key(self, image: bytes, tenant: str) -> str:
        return content_key(image, self.fingerprint, self.namespace[tenant])

    def never(self) -> str:
        """A key of alice's namespace that nobody stored."""
        return self.key(fresh_image(), "alice")

    def samples(self) -> list[str]:
        """One of alice's keys per origin (the per-key routes try these; the batch routes all)."""
        return [self.key(self.images[origin][0], "alice") for origin in ORIGINS]

    def call(self, route: str, payload: Any, token: str) -> tuple[int, Any]:
        from ray import serve

        handle = serve.get_deployment_handle("Ingress", app_name=self.app.name)
        return handle.call.remote(route, payload, token=token).result(timeout_s=60)

    def encoded(self) -> int:
        """Images the encoder replica has encoded (its own count, exact at once)."""
        return self.app.counters()["images"]

    def holds(self, keys: list[str], tenant: str = "alice") -> list[bool]:
        status, body = self.call("probe", {"keys": keys}, TOKEN[tenant])
        assert status == 200, body
        return body["exists"]


def chat_body(parts: list[dict[str, Any]]) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 1}


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def sdk(tenants: Tenants, flavor: str, transport: str, store: str | None) -> Any:
    """Bob's SDK client: ``flavor`` sync or async (driven call by call), over HTTP or the
    ingress's handle, reading ``store`` directly (None: through the service)."""
    from ray import serve

    target: dict[str, Any] = (
        {"url": tenants.app.url}
        if transport == "http"
        else {"handle": serve.get_deployment_handle("Ingress", app_name=tenants.app.name)}
    )
    if flavor == "sync":
        return EncoderClient(**target, token=BOB, store=store)
    return Blocking(AsyncEncoderClient(**target, token=BOB, store=store))


@pytest.fixture(scope="module")
def tenants(deploy, deploy_prefill, serve_url) -> Iterator[Tenants]:
    """The applications (auth on, a private Redis with a reader user per tenant) and alice's
    images, stored through every way in."""
    from ray import serve

    from tests.conftest import STOP_POLL_S
    from vitserve.deployments.common.auth import redis_readers
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.runner.local import serve_app
    from vitserve.deployments.vllm.app import build_vllm_application

    auth_only = VitserveConfig.load({"namespace": f"t-{APP}", "auth": {"tokens": TOKENS}})
    readers = redis_readers(auth_only)  # vitserve-reader-<tenant> -> its ACL rules
    password = {name: f"{name}-pw-{uuid.uuid4().hex}" for name in readers}
    args: list[str] = []
    for name, rules in readers.items():
        args += ["--user", name, "on", f">{password[name]}", *rules]
    redis = RedisServer(*args)  # the default user writes (the applications), readers read
    app = deploy(APP, store=redis.url, auth={"tokens": TOKENS})
    chat = deploy_prefill(CHAT, app)
    fake = FakeVllm()
    front_cfg = VitserveConfig.load(
        {
            **app.config.model_dump(),
            "vllm": {
                "urls": [fake.url],
                "encoder_app": app.name,
                "route_prefix": f"/{FRONT}",
                "num_cpus": 0.05,
                "graceful_shutdown_wait_loop_s": STOP_POLL_S,
            },
        }
    )
    serve_app(build_vllm_application(front_cfg), name=FRONT, route_prefix=f"/{FRONT}")
    http = httpx.Client(timeout=120)
    health = {t: http.get(f"{app.url}/healthz", headers=bearer(TOKEN[t])).json() for t in TOKEN}
    base = f"127.0.0.1:{redis.port}/0"
    t = Tenants(
        app=app,
        chat=chat,
        front_url=f"{serve_url}/{FRONT}",
        fake=fake,
        redis=redis,
        fingerprint=health["alice"]["fingerprint"],
        namespace={name: h["namespace"] for name, h in health.items()},
        reader={
            tenant: f"redis://{name}:{quote(password[name], safe='')}@{base}"
            for tenant in TOKEN
            for name in [f"vitserve-reader-{tenant}"]
        },
        http=http,
    )
    assert t.namespace == {"alice": f"t-{APP}.alice", "bob": f"t-{APP}.bob"}
    _store_alices_images(t)
    yield t
    serve.delete(FRONT)
    fake.stop()
    deploy_prefill.remove(chat.name)
    deploy.remove(app.name)
    redis.kill()
    http.close()


def _store_alices_images(t: Tenants) -> None:
    """Alice stores len(BOB_ENCODES) + 1 images through each way in; her items kept by key."""
    n = len(BOB_ENCODES) + 1
    t.images = {origin: [fresh_image() for _ in range(n)] for origin in ORIGINS}
    items: list[dict[str, Any]] = []
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(t.images[ORIGINS[0]])]
    r = t.http.post(f"{t.app.url}/v1/encode", files=files, headers=bearer(ALICE))
    assert r.status_code == 200, r.text
    items += r.json()["items"]
    doc = {"images": [{"data": base64.b64encode(b).decode()} for b in t.images["http-json"]]}
    r = t.http.post(f"{t.app.url}/v1/encode", json=doc, headers=bearer(ALICE))
    assert r.status_code == 200, r.text
    items += r.json()["items"]
    status, body = t.call("encode", {"images": t.images["handle"]}, ALICE)
    assert status == 200, body
    items += body["items"]
    with EncoderClient(t.app.url, token=ALICE) as client:
        handles = client.encode(t.images["sdk-http"])
    r = t.chat.client.post(
        f"{t.chat.url}/v1/chat/completions",
        json=chat_body([image_part(data_url(b)) for b in t.images["chat"]]),
        headers=bearer(ALICE),
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["images_encoded"] == n
    assert all("error" not in item for item in items), items
    t.items = {item["key"]: item for item in items}
    for h in handles:
        t.items[h.key] = {
            "key": h.key,
            "num_tokens": h.num_tokens,
            "grid": list(h.grid) if h.grid else None,
            "dtype": h.dtype,
            "shape": list(h.shape),
            "extras": list(h.extras),
        }
    # the chat's images: their keys as alice's SDK (inside the prefill) computed them
    keys = [t.key(b, "alice") for b in t.images["chat"]]
    status, body = t.call("probe", {"keys": keys, "headers": True}, ALICE)
    assert status == 200 and all(body["exists"]), body
    t.items.update({item["key"]: item for item in body["items"]})
    every = [t.key(b, "alice") for origin in ORIGINS for b in t.images[origin]]
    assert sorted(t.items) == sorted(every)  # each image alice's own key, all held
    assert all(t.holds(every))


def _lost(t: Tenants) -> int:
    """Alice's entries gone (each must still be hers, whatever bob did)."""
    return sum(not held for held in t.holds(sorted(t.items)))


# -- encode: alice's images are bob's new images ----------------------------------------------
def test_encoding_a_tenants_images_never_hits_the_other_tenants_entries(
    tenants: Tenants, reliability
) -> None:
    """Bob sends each of alice's images (one per origin) through every way of encoding, with a
    new image of the same size as the reference: each is encoded in bob's namespace (bob's own
    key, ``cached: false``, one encode each, counted by the encoder replica) and answered as
    the new image is, its key aside. Then alice and bob send the same new images at the same
    moment: each tenant's copy is encoded (single flight never joins across tenants)."""
    t = tenants
    tally = Tally()
    before = t.encoded()
    sent = 0
    for j, way in enumerate(BOB_ENCODES):
        images = [t.images[origin][j] for origin in ORIGINS]
        new = fresh_image()  # the reference: an image nobody sent
        got = _bob_encodes(t, way, [*images, new])
        sent += len(images) + 1
        ref = {k: v for k, v in got[-1].items() if k != "key"}
        for image, item in zip(images, got[:-1], strict=True):
            mine, theirs = t.key(image, "bob"), t.key(image, "alice")
            leaked = (
                item.get("cached") is not False
                or item["key"] != mine
                or item["key"] == theirs
                or {k: v for k, v in item.items() if k != "key"} != ref
            )
            tally.add(200, leaked, f"encode {way}: {item}")
    encoded = t.encoded() - before
    tally.add(200, encoded != sent, "encoder count")
    assert encoded == sent, (encoded, sent)

    # the same new images from both tenants at once: two encodes each, two different keys
    pairs = [fresh_image() for _ in range(4)]
    before = t.encoded()
    answers: dict[str, list[dict[str, Any]]] = {}

    def send(tenant: str) -> None:
        files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(pairs)]
        with httpx.Client(timeout=120) as c:
            r = c.post(f"{t.app.url}/v1/encode", files=files, headers=bearer(TOKEN[tenant]))
        answers[tenant] = r.json()["items"] if r.status_code == 200 else [{"status": r.status_code}]

    threads = [threading.Thread(target=send, args=(tenant,)) for tenant in TOKEN]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    encoded = t.encoded() - before
    for tenant in TOKEN:
        for image, item in zip(pairs, answers[tenant], strict=True):
            leaked = item.get("key") != t.key(image, tenant) or item.get("cached") is not False
            tally.add(item.get("status", 200), leaked, f"concurrent encode {tenant}: {item}")
    tally.add(200, encoded != 2 * len(pairs), "concurrent encoder count")
    assert encoded == 2 * len(pairs), encoded
    tally.assert_clean()
    lost = _lost(t)
    assert lost == 0
    reliability.record(
        "Cross-tenant encode: B sends A's images",
        **tally.counts(),
        lost=lost,
        note="HTTP multipart and JSON, handle, SDK on both transports, chat; also both at once",
    )


def _bob_encodes(t: Tenants, way: str, images: list[bytes]) -> list[dict[str, Any]]:
    """Bob's encode of ``images`` by ``way``: an item per image (``key``, ``cached``, shape)."""
    if way == "http-multipart":
        files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]
        r = t.http.post(f"{t.app.url}/v1/encode", files=files, headers=bearer(BOB))
        assert r.status_code == 200, r.text
        return r.json()["items"]
    if way == "http-json":
        doc = {"images": [{"data": base64.b64encode(b).decode()} for b in images]}
        r = t.http.post(f"{t.app.url}/v1/encode", json=doc, headers=bearer(BOB))
        assert r.status_code == 200, r.text
        return r.json()["items"]
    if way == "handle":
        status, body = t.call("encode", {"images": images}, BOB)
        assert status == 200, body
        return body["items"]
    if way in ("sdk-http", "sdk-handle-store"):
        client = (
            sdk(t, "sync", "http", None)
            if way == "sdk-http"
            else sdk(t, "async", "handle", t.reader["bob"])
        )
        try:
            handles = client.encode(images)
        finally:
            client.close()
        return [  # hash first: an image found held is not sent (a hit, as cached is)
            {
                "key": h.key,
                "num_tokens": h.num_tokens,
                "grid": h.grid,
                "shape": h.shape,
                "dtype": h.dtype,
                "cached": h.cached or not h.uploaded,
            }
            for h in handles
        ]
    assert way == "chat"
    r = t.chat.client.post(
        f"{t.chat.url}/v1/chat/completions",
        json=chat_body([image_part(data_url(b)) for b in images]),
        headers=bearer(BOB),
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # every image uploaded and encoded, none found: an item per image as the counts say
    fresh = usage["images_uploaded"] == usage["images_encoded"] == len(images)
    keys = [t.key(b, "bob") for b in images]
    status, body = t.call("probe", {"keys": keys, "headers": True}, BOB)
    assert status == 200, body
    return [{**(item or {"key": None}), "cached": not fresh} for item in body["items"]]


# -- probe, embeddings, rows, key-only encode: a miss, as for a key never stored -------------
def _http_cases(url: str, key: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(case, method, url, httpx kwargs) of every HTTP route that names a key."""
    return [
        ("probe", "POST", f"{url}/v1/probe", {"json": {"keys": [key]}}),
        ("probe+headers", "POST", f"{url}/v1/probe", {"json": {"keys": [key], "headers": True}}),
        ("embeddings", "GET", f"{url}/v1/embeddings/{key}", {}),
        ("embeddings rows", "GET", f"{url}/v1/embeddings/{key}?start=0&end=1", {}),
        ("rows", "POST", f"{url}/v1/rows", {"json": {"reads": [[key, 0, 1]]}}),
        ("encode key", "POST", f"{url}/v1/encode", {"json": {"images": [{"key": key}]}}),
    ]


def _handle_cases(key: str) -> list[tuple[str, str, Any]]:
    return [
        ("handle probe", "probe", {"keys": [key]}),
        ("handle probe+headers", "probe", {"keys": [key], "headers": True}),
        ("handle rows", "rows", {"reads": [[key, 0, 1]]}),
        ("handle encode key", "encode", {"images": [key]}),
    ]


#: the answer headers a reply may differ by only if it differs in what it says
_HEADERS = ("content-type", "x-vitserve-row-start", "x-vitserve-num-tokens", "retry-after")


def _http_view(r: httpx.Response, key: str) -> tuple[Any, ...]:
    return (
        r.status_code,
        tuple(r.headers.get(h) for h in _HEADERS),
        normalized(r.content.decode("latin-1"), key),
    )


def _reveals(case: str, r: httpx.Response) -> bool:
    """Whether an answer to bob holds anything of alice's entry (exists, a header, a record)."""
    if r.status_code != 200:
        return False
    if case.startswith("probe"):
        doc = r.json()
        return any(doc["exists"]) or any(doc.get("items") or [])
    if case == "rows":
        return any(rec is not None for rec in unpack_records(r.content))
    if case == "encode key":
        return "error" not in r.json()["items"][0]
    return True  # an embedding answered 200


def _handle_reveals(route: str, body: dict[str, Any]) -> bool:
    """Whether a handle answer (200) holds anything of alice's entry."""
    if route == "probe":
        return any(body["exists"]) or any(body.get("items") or [])
    if route == "rows":
        return any(record is not None for record in body["records"])
    return "error" not in body["items"][0]  # a key-only encode item that was found


def test_probes_and_reads_of_another_tenants_keys_answer_as_for_a_key_never_stored(
    tenants: Tenants, reliability
) -> None:
    """For one of alice's keys per origin, and each paired with a key nobody stored: bob's
    probes (with and without headers), embedding fetches (whole and rows), ``/v1/rows`` and
    key-only encodes over HTTP and the ingress's handle answer a miss, with the same status,
    headers and body as for the key never stored (the key aside). Then all of alice's keys in
    one probe and one rows read: all absent."""
    t = tenants
    probes, reads = Tally(), Tally()
    for key in t.samples():
        for case, method, url, kwargs in _http_cases(t.app.url, key):
            never = t.never()
            got = t.http.request(method, url, headers=bearer(BOB), **kwargs)
            ref = t.http.request(
                method,
                url.replace(key, never),
                headers=bearer(BOB),
                **json.loads(json.dumps(kwargs).replace(key, never)),
            )
            leaked = _reveals(case, got) or _http_view(got, key) != _http_view(ref, never)
            tally = probes if case.startswith("probe") else reads
            tally.add(got.status_code, leaked, f"{case} {key}: {got.status_code} {got.text[:200]}")
        for case, route, payload in _handle_cases(key):
            never = t.never()
            status, body = t.call(route, payload, BOB)
            ref_status, ref = t.call(
                route, json.loads(json.dumps(payload).replace(key, never)), BOB
            )
            revealed = status == 200 and _handle_reveals(route, body)
            same = (status, normalized(repr(body), key)) == (
                ref_status,
                normalized(repr(ref), never),
            )
            tally = probes if "probe" in case else reads
            tally.add(status, revealed or not same, f"{case} {key}: {status} {body}")

    # every key of alice's at once (batch probe, batch rows): all absent
    keys = sorted(t.items)
    r = t.http.post(
        f"{t.app.url}/v1/probe", json={"keys": keys, "headers": True}, headers=bearer(BOB)
    )
    absent = r.status_code == 200 and r.json() == {
        "exists": [False] * len(keys),
        "items": [None] * len(keys),
    }
    probes.add(r.status_code, not absent, f"batch probe: {r.text[:300]}")
    r = t.http.post(
        f"{t.app.url}/v1/rows", json={"reads": [[k, 0, 1] for k in keys]}, headers=bearer(BOB)
    )
    none = r.status_code == 200 and unpack_records(r.content) == [None] * len(keys)
    reads.add(r.status_code, not none, f"batch rows: {r.status_code}")
    # bob's own keys of alice's images, computed with his namespace: nobody stored those yet
    own = [t.key(t.images["chat"][0], "bob"), t.key(t.images["handle"][0], "bob")]
    own_absent = not any(t.holds(own, "bob")) or _bob_encoded_already(t, own)
    probes.add(200, not own_absent, "bob's own keys of alice's images")
    probes.assert_clean()
    reads.assert_clean()
    lost = _lost(t)
    assert lost == 0
    reliability.record(
        "Cross-tenant probe: B probes A's keys",
        **probes.counts(),
        lost=lost,
        note="HTTP with and without headers, handle; same answer as a key never stored",
    )
    reliability.record(
        "Cross-tenant reads: B reads A's keys",
        **reads.counts(),
        lost=lost,
        note="embeddings whole and rows, /v1/rows, key-only encode, HTTP and handle",
    )


def _bob_encoded_already(t: Tenants, keys: list[str]) -> bool:
    """Whether bob's encode test (it may have run first) stored these keys of his: then they
    are his own entries, not alice's."""
    return all(t.holds(keys, "bob"))


# -- the SDK: both clients, both transports, with and without a direct store --------------------
def test_the_sdk_of_one_tenant_never_finds_or_reads_anothers_entries(
    tenants: Tenants, reliability
) -> None:
    """Bob's SDK (sync and async, over HTTP and the handle, without a direct store, with his
    Redis reader and with the store's full URL) learns his namespace from ``/healthz``: its
    probe of alice's keys finds none, and a fetch of alice's handle (her exact item, no image
    bytes) raises CacheMissError, as for a handle of a key never stored. The direct store is
    opened in bob's namespace; bob's reader opened on alice's namespace is refused by Redis
    (NOPERM), whatever key it asks for; alice's reader reads her entries (the control)."""
    from vitserve.cache.urls import open_store

    t = tenants
    tally = Tally()
    keys = sorted(t.items)
    samples = t.samples()
    for store in (None, t.reader["bob"], t.redis.url):
        for flavor in ("sync", "async"):
            for transport in ("http", "handle"):
                client = sdk(t, flavor, transport, store)
                name = f"sdk {flavor} {transport} store={store is not None}"
                try:
                    found = _outcome(lambda c=client: c.probe(keys), "")
                    if store is not None:
                        direct = getattr(client.core.store, "namespace", None)
                        tally.add(200, direct != t.namespace["bob"], f"{name}: namespace {direct}")
                    tally.add(
                        200, found != ("ok", repr([None] * len(keys))), f"{name}: probe {found}"
                    )
                    for key in samples:
                        never = t.never()
                        mine = ImageHandle.from_item(t.items[key])
                        ref = ImageHandle.from_item({**t.items[key], "key": never})
                        got = _outcome(lambda c=client, h=mine: c.fetch([h]), key)
                        want = _outcome(lambda c=client, h=ref: c.fetch([h]), never)
                        leaked = got[0] != "CacheMissError" or got != want
                        tally.add(200, leaked, f"{name}: fetch {key}: {got}")
                finally:
                    client.close()

    # the direct store itself: bob's reader, in his namespace and then in alice's
    mine = open_store(t.reader["bob"], namespace=t.namespace["bob"], fingerprint=t.fingerprint)
    peek = open_store(t.reader["bob"], namespace=t.namespace["alice"], fingerprint=t.fingerprint)
    hers = open_store(t.reader["alice"], namespace=t.namespace["alice"], fingerprint=t.fingerprint)
    try:
        tally.add(200, any(r is not None for r in mine.get_many(keys)), "reader bob: get_many")
        tally.add(200, any(mine.headers_many(keys)), "reader bob: headers_many")
        tally.add(200, any(mine.exists_many(keys)), "reader bob: exists_many")
        for method, args in (
            ("get_many", (keys,)),
            ("headers_many", (keys,)),
            ("exists_many", (keys,)),
            ("get_rows_many", ([(k, 0, 1) for k in keys], {})),
        ):
            outcome = _outcome(lambda m=method, a=args: getattr(peek, m)(*a), "")
            refused = outcome[0] == "StoreError" and "may not" in outcome[1]
            tally.add(200, not refused, f"reader bob on alice's namespace: {method}: {outcome}")
        control = hers.get_many(keys)
        assert all(r is not None for r in control)  # alice's reader reads her own
    finally:
        for store in (mine, peek, hers):
            store.close()
    tally.assert_clean()
    lost = _lost(t)
    assert lost == 0
    reliability.record(
        "Cross-tenant SDK and direct store: B's client on A's keys",
        **tally.counts(),
        lost=lost,
        note="sync and async, HTTP and handle, no store, B's Redis reader, the full store URL; "
        "B's reader on A's namespace refused",
    )


def _outcome(fn: Callable[[], Any], key: str) -> tuple[str, str]:
    """``fn()``'s outcome as (kind, text with ``key`` as KEY): the error's class and message,
    or ``ok`` and what it returned."""
    try:
        value = fn()
    except StoreError as exc:
        kind = type(exc).__name__ if isinstance(exc, CacheMissError) else "StoreError"
        return kind, normalized(str(exc), key) if key else str(exc)
    except VitserveError as exc:
        return type(exc).__name__, normalized(str(exc), key) if key else str(exc)
    return "ok", repr(value)


# -- the prefill chat: vitserve://<alice's key> -----------------------------------------------
def test_a_chat_naming_another_tenants_key_is_refused_as_a_key_never_stored(
    tenants: Tenants, reliability
) -> None:
    """Bob's chat naming one of alice's images as ``vitserve://<key>`` (alone, and beside an
    inline image of his own) is a 404 CacheMissError, the same answer as for a key never
    stored; nothing is generated from alice's embedding. Alice's own chat of the key is
    answered (the control)."""
    t = tenants
    tally = Tally()
    for key in t.samples():
        for extra in ([], [image_part(data_url(fresh_image()))]):
            never = t.never()
            got = t.chat.client.post(
                f"{t.chat.url}/v1/chat/completions",
                json=chat_body([image_part(f"vitserve://{key}"), *extra]),
                headers=bearer(BOB),
            )
            ref = t.chat.client.post(
                f"{t.chat.url}/v1/chat/completions",
                json=chat_body([image_part(f"vitserve://{never}"), *extra]),
                headers=bearer(BOB),
            )
            leaked = (
                got.status_code != 404
                or got.json()["error"]["type"] != "CacheMissError"
                or _http_view(got, key) != _http_view(ref, never)
            )
            tally.add(got.status_code, leaked, f"chat vitserve:// {key}: {got.status_code}")
    control = t.chat.client.post(
        f"{t.chat.url}/v1/chat/completions",
        json=chat_body([image_part(f"vitserve://{t.samples()[0]}")]),
        headers=bearer(ALICE),
    )
    assert control.status_code == 200, control.text
    tally.assert_clean()
    lost = _lost(t)
    assert lost == 0
    reliability.record(
        "Cross-tenant prefill chat: B names A's images as vitserve://<key>",
        **tally.counts(),
        lost=lost,
        note="alone and beside an inline image; same answer as a key never stored",
    )


# -- what tells a tenant about the service names no other tenant --------------------------------
def test_health_and_stats_name_no_other_tenant_and_no_key(tenants: Tenants) -> None:
    """``/healthz`` with bob's token names bob's namespace only; ``/v1/stats`` (counters of the
    replicas, every tenant's traffic) is the operator's: a tenant's token is refused."""
    t = tenants
    health = t.http.get(f"{t.app.url}/healthz", headers=bearer(BOB))
    assert health.status_code == 200
    assert health.json()["namespace"] == t.namespace["bob"] and "alice" not in health.text
    for token in (ALICE, BOB):
        stats = t.http.get(f"{t.app.url}/v1/stats", headers=bearer(token))
        assert stats.status_code == 401, stats.text
        assert "alice" not in stats.text and "bob" not in stats.text


# -- the vLLM front: what reaches vLLM names bob's keys only -------------------------------------
def _front_chat(t: Tenants, parts: list[dict[str, Any]], token: str) -> httpx.Response:
    body = {"model": "tiny", **chat_body(parts)}
    return t.http.post(f"{t.front_url}/v1/chat/completions", json=body, headers=bearer(token))


def _forwarded_parts(t: Tenants) -> list[dict[str, Any]]:
    return [p for p in t.fake.seen[-1]["messages"][0]["content"] if p.get("type") != "text"]


def test_the_vllm_front_names_each_image_by_the_callers_own_key(
    tenants: Tenants, reliability
) -> None:
    """Through the vLLM front, bob's data-URL images (alice's, and his own with alice's key
    written as their ``uuid``, in the long and vLLM's short form) are encoded in his namespace
    (``x-vitserve-uploaded``, none cached: zero hits across tenants) and reach vLLM named by
    bob's keys, never by alice's."""
    t = tenants
    tally = Tally()
    alices = [t.images[origin][-1] for origin in ORIGINS]  # the ones bob sends nowhere else
    for image in alices:
        key = t.key(image, "alice")
        own = fresh_image()
        parts = [
            image_part(data_url(image)),
            {**image_part(data_url(own)), "uuid": key},
            {"image_url": data_url(own), "uuid": key},  # vLLM's short form
        ]
        r = _front_chat(t, parts, BOB)
        assert r.status_code == 200, r.text
        counts = tuple(int(r.headers[f"x-vitserve-{k}"]) for k in ("uploaded", "cached"))
        forwarded = [p.get("uuid") for p in _forwarded_parts(t)]
        bob = t.namespace["bob"]  # the front names an entry <namespace>/<key>
        want = [f"{bob}/{t.key(image, 'bob')}", *[f"{bob}/{t.key(own, 'bob')}"] * 2]
        leaked = counts != (2, 0) or forwarded != want or key in json.dumps(t.fake.seen[-1])
        tally.add(r.status_code, leaked, f"front: {counts} {forwarded}")
    tally.assert_clean()
    lost = _lost(t)
    assert lost == 0
    reliability.record(
        "Cross-tenant vLLM front: B's data-URL images",
        **tally.counts(),
        lost=lost,
        note="A's images and B's own with A's key as uuid; named by B's keys only (fake vLLM)",
    )


#: image parts the front does not encode (no data: URL it reads), each carrying alice's key as
#: the uuid bob wrote: what vLLM looks its caches and vitserve's connector up by
def _unkeyed_parts(image: bytes, key: str) -> dict[str, dict[str, Any]]:
    return {
        "uuid only (no image)": {"type": "image_url", "image_url": None, "uuid": key},
        "DATA: URL": {**image_part(data_url(image, "DATA")), "uuid": key},
        "input_image part": {"type": "input_image", "image_url": data_url(image), "uuid": key},
        "remote URL": {**image_part("http://127.0.0.1:9/cat.png"), "uuid": key},
    }


def test_the_vllm_front_never_forwards_another_tenants_key(tenants: Tenants, reliability) -> None:
    """Bob writes one of alice's keys as the ``uuid`` of an image part the front does not
    encode: what reaches vLLM must not name alice's key (the front would drop the uuid, or
    refuse the part)."""
    t = tenants
    key = t.key(t.images["http-json"][0], "alice")
    forwarded: dict[str, Any] = {}
    for case, part in _unkeyed_parts(fresh_image(), key).items():
        before = len(t.fake.seen)
        r = _front_chat(t, [copy.deepcopy(part)], BOB)
        reached = len(t.fake.seen) > before
        forwarded[case] = (r.status_code, reached and key in json.dumps(t.fake.seen[-1]))
    assert not any(named for _, named in forwarded.values()), forwarded
    reliability.record(
        "Cross-tenant vLLM front: B writing A's key as a part's uuid",
        tried=len(forwarded),
        failed=sum(status >= 500 for status, _ in forwarded.values()),
        wrong=0,
        lost=0,
        note="uuid-only, DATA: URL, input_image and remote-URL parts: re-keyed or refused 422",
    )
