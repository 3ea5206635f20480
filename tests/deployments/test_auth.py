"""Bearer-token auth and tenant isolation (vitserve.deployments.common.auth).

First the token check alone (fast, no Ray). Then a real vitserve application with two tenants,
alice and bob (real Serve, real HTTP, the suite's Redis), with a prefill application beside it,
reached over HTTP, through the ingress's Serve handle, through the SDK (both clients, both
transports, with and without a direct store) and through the chat route. Auth off, the
default, is what every other test of the suite runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.blocking import Blocking
from tests.reliability_table import Tally
from vitserve.client import AsyncEncoderClient, EncoderClient
from vitserve.deployments.common import auth
from vitserve.deployments.common.auth import Authenticator, Tenant, bearer_token, read_tokens_file
from vitserve.deployments.common.config import VitserveConfig
from vitserve.errors import AuthenticationError, CacheMissError, ConfigError
from vitserve.keys import content_key
from vitserve.testing.images import make_image

ALICE = "alice-token-0123456789abcdef"
ALICE_2 = "alice-rotated-token-9876543210"  # a second token of the same tenant
BOB = "bob-token-fedcba9876543210xyz"
TOKENS = [
    {"tenant": "alice", "token": ALICE},
    {"tenant": "alice", "token": ALICE_2},
    {"tenant": "bob", "token": BOB},
]
# Authorization headers that must not pass: none, other schemes, empty, near misses
BAD_HEADERS: list[str | None] = [
    None,
    "",
    "Basic YWxpY2U6eA==",
    "Bearer",
    f"Bearer {ALICE[:-1]}",
    f"Bearer {ALICE}x",
    f"Token {ALICE}",
    f"Bearer {ALICE.upper()}",
    "Bearer unknown-0123456789xyz",
]
BAD_TOKENS: list[str | None] = [None, "", ALICE[:-1], ALICE + "x", "unknown-token-0123456789"]


# -- the token check alone -----------------------------------------------------------------------
def test_the_token_check() -> None:
    a = Authenticator([(t["tenant"], t["token"]) for t in TOKENS], prefix="prod")
    assert a.tenant(ALICE) == a.tenant(ALICE_2) == Tenant("alice", "prod.alice")
    assert a.tenant(BOB) == Tenant("bob", "prod.bob")
    assert Authenticator([("bob", BOB)]).tenant(BOB).namespace == "bob"  # no prefix
    with pytest.raises(AuthenticationError) as missing:
        a.tenant(None)
    assert (missing.value.reason, missing.value.http_status) == ("missing", 401)
    assert missing.value.challenge == 'Bearer realm="vitserve"'
    for token in ["", ALICE[:-1], ALICE + "x", ALICE.upper(), " " + ALICE, BOB[::-1]]:
        with pytest.raises(AuthenticationError) as wrong:
            a.tenant(token)
        assert wrong.value.reason == "invalid" and 'error="invalid_token"' in wrong.value.challenge
    assert bearer_token(f"Bearer {ALICE}") == bearer_token(f"bearer  {ALICE} ") == ALICE
    no_token = (None, "", "Bearer", "Bearer  ", f"Basic {ALICE}")
    assert all(bearer_token(h) is None for h in no_token)
    with pytest.raises(ConfigError):
        Authenticator([])
    with pytest.raises(ConfigError):
        Authenticator([("alice", ALICE), ("bob", ALICE)])


def test_every_configured_token_is_compared_whatever_matches(monkeypatch) -> None:
    """No early exit: the same number of constant-time comparisons for the first token, the
    last, and none, over equal-length digests."""
    tokens = [(f"t{i}", f"token-number-{i:04d}-abcdefgh") for i in range(50)]
    a = Authenticator(tokens)
    calls: list[tuple[int, int]] = []
    real = auth.hmac.compare_digest

    def counting(x: bytes, y: bytes) -> bool:
        calls.append((len(x), len(y)))
        return real(x, y)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token in (tokens[0][1], tokens[-1][1], "no-such-token-anywhere-000"):
        calls.clear()
        with contextlib.suppress(AuthenticationError):
            a.tenant(token)
        assert len(calls) == len(tokens)
        assert {c for c in calls} == {(32, 32)}  # digests: the length of a token never shows


def test_tokens_from_a_mounted_secret_file(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# rotated monthly\nalice:{ALICE}\n\n  bob : {BOB}  \n")
    assert read_tokens_file(str(path)) == [("alice", ALICE), ("bob", BOB)]
    cfg = VitserveConfig.load({"namespace": "p", "auth.tokens_file": str(path)})
    assert cfg.auth.enabled and Authenticator.from_config(cfg).tenant(BOB).namespace == "p.bob"
    path.write_text(f"alice:{ALICE}\nbob {BOB}\n")
    with pytest.raises(ConfigError, match="line 2") as bad:
        read_tokens_file(str(path))
    assert BOB not in str(bad.value)  # the error names the line, never the secret
    with pytest.raises(ConfigError):
        read_tokens_file(str(tmp_path / "absent"))
    assert Authenticator.from_config(VitserveConfig.load({})) is None  # off by default


def test_tokens_come_from_the_environment_and_never_show_in_the_config_log() -> None:
    env = {"VITSERVE_AUTH__TOKENS": json.dumps([{"tenant": "alice", "token": ALICE}])}
    cfg = VitserveConfig.load(environ=env)
    assert cfg.auth.tokens[0].token.get_secret_value() == ALICE
    dumps = [cfg.model_dump_json(), repr(cfg), str(cfg.model_dump())]
    if hasattr(cfg, "effective_json"):  # what the service logs
        dumps.append(cfg.effective_json())
    assert all(ALICE not in d for d in dumps)
    with pytest.raises(ConfigError, match="at least"):
        VitserveConfig.load({"auth.tokens": [{"tenant": "alice", "token": "short"}]})
    with pytest.raises(ConfigError, match="tenant"):
        VitserveConfig.load({"auth.tokens": [{"tenant": "a.b", "token": ALICE}]})


# -- a service with two tenants ------------------------------------------------------------------
_seed = iter(range(70_000, 10**9))


def fresh_image() -> bytes:
    return make_image(64, 48, seed=next(_seed))


RELOAD_S = 1.0  # how often the replicas look at the tokens file here (5 s by default)
SCRAPE = "scrape-token-0123456789abcdef"


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory) -> dict[str, Path]:
    """A tokens file (no tenant yet: alice and bob are the config's own) and a scrape-token
    file, as a mounted Secret holds them."""
    folder = tmp_path_factory.mktemp("secret")
    files = {"tokens": folder / "tokens", "scrape": folder / "scrape-token"}
    files["tokens"].write_text("# tenants added while the service runs\n")
    files["scrape"].write_text(SCRAPE)
    return files


@pytest.fixture(scope="module")
def services(deploy, deploy_prefill, redis_url, secret_files) -> Iterator[tuple[Any, Any]]:
    """The encoder application with auth on (tenant namespaces ``t-auth.alice`` and
    ``t-auth.bob``, Redis store; more tenants from a tokens file it follows, and a scrape
    token) and a prefill application over it."""
    auth = {
        "tokens": TOKENS,
        "tokens_file": str(secret_files["tokens"]),
        "scrape_token_file": str(secret_files["scrape"]),
        "reload_s": RELOAD_S,
    }
    encoder = deploy("auth", store=redis_url, auth=auth)
    chat = deploy_prefill("auth-llm", encoder)
    yield encoder, chat
    deploy_prefill.remove(chat.name)
    deploy.remove(encoder.name)


def _headers(token_or_header: str | None, raw: bool = False) -> dict[str, str]:
    if token_or_header is None:
        return {}
    return {"Authorization": token_or_header if raw else f"Bearer {token_or_header}"}


def _ingress(app: Any) -> Any:
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=app.name)


def _call(app: Any, route: str, payload: Any, token: str | None) -> tuple[int, Any]:
    kwargs = {} if token is None else {"token": token}
    return _ingress(app).call.remote(route, payload, **kwargs).result(timeout_s=60)


def _encode(app: Any, image: bytes, token: str) -> dict[str, Any]:
    r = app.client.post(
        f"{app.url}/v1/encode",
        headers=_headers(token),
        files=[("images", ("0.png", image, "image/png"))],
    )
    assert r.status_code == 200, r.text
    return r.json()["items"][0]


def _http_requests(app: Any, key: str, image: bytes) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, url, httpx kwargs) of every route that reads or writes embeddings."""
    u = app.url
    data = base64.b64encode(image).decode()
    return [
        ("POST", f"{u}/v1/encode", {"files": [("images", ("0.png", image, "image/png"))]}),
        ("POST", f"{u}/v1/encode", {"json": {"images": [{"data": data}]}}),
        ("POST", f"{u}/v1/encode", {"json": {"images": [{"key": key}]}}),
        ("POST", f"{u}/v1/probe", {"json": {"keys": [key]}}),
        ("POST", f"{u}/v1/probe", {"json": {"keys": [key], "headers": True}}),
        ("POST", f"{u}/v1/rows", {"json": {"reads": [[key, 0, 1]]}}),
        ("GET", f"{u}/v1/embeddings/{key}", {}),
        ("GET", f"{u}/v1/embeddings/{key}?start=0&end=1", {}),
    ]


def _handle_calls(key: str, image: bytes) -> list[tuple[str, Any]]:
    return [
        ("encode", {"images": [image]}),
        ("encode", {"images": [key]}),
        ("probe", {"keys": [key], "headers": True}),
        ("rows", {"reads": [[key, 0, 1]]}),
    ]


def _chat_body(key: str) -> dict[str, Any]:
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"vitserve://{key}"}},
    ]
    return {"messages": [{"role": "user", "content": parts}], "temperature": 0, "max_tokens": 1}


def _client(flavor: str, target: dict[str, Any], **kw: Any) -> Any:
    return (
        EncoderClient(**target, **kw)
        if flavor == "sync"
        else Blocking(AsyncEncoderClient(**target, **kw))
    )


def _clients(app: Any, **kw: Any) -> list[tuple[str, Any]]:
    """An EncoderClient and an AsyncEncoderClient per transport."""
    return [
        (f"{flavor}-{name}", _client(flavor, target, **kw))
        for flavor in ("sync", "async")
        for name, target in (("http", {"url": app.url}), ("handle", {"handle": _ingress(app)}))
    ]


def _run(client: Any, method: str, *args: Any) -> Any:
    """``client.method(*args)``, then the client closed."""
    try:
        return getattr(client, method)(*args)
    finally:
        client.close()


def test_requests_without_a_valid_token_are_refused(services, secret_files, reliability) -> None:
    """No token, another scheme or an unknown token: 401 in the error shape with
    ``WWW-Authenticate: Bearer`` on every route that needs a token (HTTP, the ingress's handle,
    the SDK over both transports, the chat route), and nothing is encoded or read."""
    app, chat = services
    image = fresh_image()
    held = _encode(app, image, ALICE)["key"]  # alice's entry, probed for with bad tokens
    before = app.counters()["images"]
    tally = Tally()
    for header in BAD_HEADERS:
        for method, url, kwargs in _http_requests(app, held, fresh_image()):
            r = app.client.request(method, url, headers=_headers(header, raw=True), **kwargs)
            tally.add(r.status_code, r.status_code != 401)
            assert r.status_code == 401, (method, url, header, r.text)
            assert r.json()["error"]["type"] == "AuthenticationError"
            assert r.headers["www-authenticate"].startswith("Bearer realm=")
        r = chat.client.post(
            f"{chat.url}/v1/chat/completions",
            json=_chat_body(held),
            headers=_headers(header, raw=True),
        )
        tally.add(r.status_code, r.status_code != 401)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r.text
    for token in BAD_TOKENS:
        for route, payload in _handle_calls(held, fresh_image()):
            status, body = _call(app, route, payload, token)
            tally.add(status, status != 401)
            assert status == 401 and body["error"]["type"] == "AuthenticationError", (route, body)
        for _, client in _clients(app, token=token, store=None):
            with pytest.raises(AuthenticationError):
                _run(client, "encode", [fresh_image()])
            tally.tried += 1
    # healthz: liveness without a token, nothing about the model or a namespace; 401 with a
    # wrong one. /metrics answers the scrape token alone, no tenant's (see the rotation tests).
    r = app.client.get(f"{app.url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "auth": "bearer"}
    r = app.client.get(f"{app.url}/healthz", headers=_headers(BOB[:-1]))
    tally.add(r.status_code, r.status_code != 401)
    assert r.status_code == 401
    assert _call(app, "healthz", None, None) == (200, {"status": "ok", "auth": "bearer"})
    status, _ = _call(app, "healthz", None, "wrong-token-0123456789")
    tally.add(status, status != 401)
    assert status == 401
    for header in ({}, _headers(ALICE), _headers(BOB)):
        r = app.client.get(f"{app.url}/metrics", headers=header)
        tally.add(r.status_code, r.status_code != 401)
        assert r.status_code == 401, r.text
    # /v1/stats: every tenant's counters, so the operator's (the scrape token), no tenant's
    for header in ({}, _headers(ALICE), _headers(BOB)):
        r = app.client.get(f"{app.url}/v1/stats", headers=header)
        tally.add(r.status_code, r.status_code != 401)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = app.client.get(f"{app.url}/v1/stats", headers=_headers(_scrape_token(secret_files)))
    assert r.status_code == 200 and r.json()["encoder"]["images"] == before, r.text
    assert app.counters()["images"] == before  # nothing reached the encoder
    # alice's entry is intact
    lost = int(_call(app, "probe", {"keys": [held]}, ALICE)[1]["exists"] != [True])
    assert lost == 0
    reliability.record(
        "Auth: requests with no or a wrong token",
        **tally.counts(),
        lost=lost,
        note="HTTP, handle, SDK and chat routes",
    )


def _same_answer(a: str, b: str, key_a: str, key_b: str) -> bool:
    """Whether two answers are the same once each names its own key."""

    def norm(text: str, key: str) -> str:
        return re.sub(f"{key}|{key[:16]}", "KEY", text)

    return norm(a, key_a) == norm(b, key_b)


def test_a_tenant_cannot_probe_or_read_another_tenants_keys(
    services, redis_url, reliability
) -> None:
    """bob knows alice's key: every probe and read answers a miss, the same answer as for a key
    never stored (HTTP, handle, SDK on both transports with and without a direct store, chat)."""
    from vitserve.cache.codec import unpack_records

    app, chat = services
    image = fresh_image()
    item = _encode(app, image, ALICE)
    key = item["key"]
    never = content_key(fresh_image(), "0" * 64, "nowhere")
    tally = Tally()

    # HTTP: bob with alice's key, then with a key never stored: the same answers
    for method, url, kwargs in _http_requests(app, key, image)[2:]:  # the key-only routes
        got = app.client.request(method, url, headers=_headers(BOB), **kwargs)
        ref = app.client.request(
            method,
            url.replace(key, never),
            headers=_headers(BOB),
            **json.loads(json.dumps(kwargs).replace(key, never)),
        )
        leaked = got.status_code == 200 and (
            b"true" in got.content
            or (url.endswith("/rows") and unpack_records(got.content)[0] is not None)
        )
        if "/v1/embeddings/" in url:
            leaked = got.status_code != 404
        tally.add(got.status_code, leaked or got.status_code != ref.status_code)
        assert not leaked and got.status_code == ref.status_code, (url, got.text)
        if got.headers.get("content-type", "").startswith("application/json"):
            assert _same_answer(got.text, ref.text, key, never), (got.text, ref.text)
        else:
            assert got.content == ref.content
    r = app.client.post(
        f"{app.url}/v1/encode", headers=_headers(BOB), json={"images": [{"key": key}]}
    )
    assert r.json()["items"][0]["error"]["type"] == "CacheMissError"

    # the ingress's handle
    for route, payload in _handle_calls(key, image)[1:]:  # the key-only calls
        status, body = _call(app, route, payload, BOB)
        _, ref = _call(app, route, json.loads(json.dumps(payload).replace(key, never)), BOB)
        leaked = status != 200 or body != json.loads(json.dumps(ref).replace(never, key))
        if route == "encode":
            leaked = status != 200 or "error" not in body["items"][0]
        tally.add(status, leaked)
        assert not leaked, (route, body)

    # the SDK: probes miss, fetches of alice's handle fail as a miss, with a direct store too
    from vitserve.client import ImageHandle

    handle = ImageHandle.from_item(item)  # no image bytes: a miss cannot be re-encoded
    for store in (None, redis_url):
        for name, client in _clients(app, token=BOB, store=store):
            found = _run(client, "probe", [key])
            tally.add(200, found != [None])
            assert found == [None], name
        for _, client in _clients(app, token=BOB, store=store):
            with pytest.raises(CacheMissError):
                _run(client, "fetch", [handle])
            tally.tried += 1

    # a chat of bob's naming alice's image is refused as a miss; alice's own is answered
    r = chat.client.post(
        f"{chat.url}/v1/chat/completions", json=_chat_body(key), headers=_headers(BOB)
    )
    tally.add(r.status_code, r.status_code != 404)
    assert r.status_code == 404 and r.json()["error"]["type"] == "CacheMissError", r.text
    r = chat.client.post(
        f"{chat.url}/v1/chat/completions", json=_chat_body(key), headers=_headers(ALICE_2)
    )
    assert r.status_code == 200, r.text

    lost = int(_call(app, "probe", {"keys": [key]}, ALICE)[1]["exists"] != [True])
    assert lost == 0
    reliability.record(
        "Tenant isolation: B probing and reading A's keys",
        **tally.counts(),
        lost=lost,
        note="HTTP, handle, SDK with and without a direct store, chat",
    )


def test_the_same_image_is_each_tenants_own_entry(services) -> None:
    app, _ = services
    image = fresh_image()
    health = app.client.get(f"{app.url}/healthz", headers=_headers(ALICE)).json()
    assert (health["tenant"], health["namespace"]) == ("alice", "t-auth.alice")
    fp = health["fingerprint"]
    a = _encode(app, image, ALICE)
    before = app.counters()["images"]
    b = _encode(app, image, BOB)
    assert a["key"] == content_key(image, fp, "t-auth.alice")
    assert b["key"] == content_key(image, fp, "t-auth.bob") != a["key"]
    assert not b["cached"] and app.counters()["images"] == before + 1  # bob's own entry
    assert _encode(app, image, ALICE_2)["cached"]  # alice's other token: her namespace
    for token, mine, theirs in ((ALICE, a, b), (BOB, b, a)):
        r = app.client.post(
            f"{app.url}/v1/probe",
            headers=_headers(token),
            json={"keys": [mine["key"], theirs["key"]]},
        )
        assert r.json()["exists"] == [True, False]


@pytest.mark.parametrize("transport", ["http", "handle"])
@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_the_sdk_keys_and_reads_in_its_tenants_namespace(
    services, redis_url, flavor, transport
) -> None:
    """The SDK learns its namespace from /healthz, so the keys it computes are the service's;
    its direct store is opened under that namespace and reads the tenant's own rows."""
    import numpy as np

    app, _ = services
    target: dict[str, Any] = {"url": app.url} if transport == "http" else {"handle": _ingress(app)}
    image = fresh_image()
    client = _client(flavor, target, token=BOB, store=redis_url)
    try:
        model = client.describe()
        handles = client.encode([image])
        records = client.fetch(handles)
        core = client.core if flavor == "sync" else client.client.core
        assert core.store.namespace == "t-auth.bob"  # the direct store: bob's namespace
    finally:
        client.close()
    assert (model["namespace"], model["tenant"]) == ("t-auth.bob", "bob")
    assert handles[0].key == content_key(image, model["fingerprint"], "t-auth.bob")
    with httpx.Client(timeout=60) as http:  # the same rows over HTTP, as bob
        r = http.get(f"{app.url}/v1/embeddings/{handles[0].key}", headers=_headers(BOB))
    from vitserve.cache.codec import decode_record

    assert np.array_equal(decode_record(r.content).embedding, records[0].embedding)


# -- the tokens file and the scrape token, changing under the running service --------------------
DAVE = "dave-token-0123456789abcdefgh"  # a tenant only the tokens file names
SCRAPE_2 = "scrape-token-rotated-987654321"


def _scrape_token(files: dict[str, Path]) -> str:
    """The scrape token in force (the file's: a test may have rotated it)."""
    return files["scrape"].read_text().strip()


def _swap(path: Path, text: str) -> None:
    """Replace ``path``'s content as the kubelet updates a mounted Secret: a new file renamed
    over it (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _status(app: Any, path: str, token: str | None) -> int:
    return app.client.get(f"{app.url}{path}", headers=_headers(token)).status_code


def _until(app: Any, path: str, token: str, status: int, limit_s: float) -> float:
    """Seconds until ``path`` with ``token`` answers ``status`` (polled), at most ``limit_s``."""
    started = time.monotonic()
    while (got := _status(app, path, token)) != status:
        assert time.monotonic() - started < limit_s, (path, got)
        time.sleep(0.05)
    return time.monotonic() - started


def test_tokens_rotate_over_http_without_a_restart(services, secret_files, reliability) -> None:
    """A tenant added to the followed file is answered, and removed is refused, within
    reload_s (plus the polling), by the same ingress replica; the config's tenants are
    untouched throughout."""
    app, _ = services

    def replica() -> str:
        scrape = _headers(_scrape_token(secret_files))
        return app.client.get(f"{app.url}/v1/stats", headers=scrape).json()["ingress"]["replica"]

    assert _status(app, "/healthz", DAVE) == 401  # /healthz with a token: the tenant's details
    before = replica()
    _swap(secret_files["tokens"], f"dave:{DAVE}\n")
    added = _until(app, "/healthz", DAVE, 200, RELOAD_S + 5)
    _swap(secret_files["tokens"], "# dave left\n")
    removed = _until(app, "/healthz", DAVE, 401, RELOAD_S + 5)
    assert _status(app, "/healthz", ALICE) == _status(app, "/healthz", BOB) == 200
    assert replica() == before  # no restart
    assert added <= RELOAD_S + 1 and removed <= RELOAD_S + 1, (added, removed)
    reliability.record(
        f"token rotation without a restart (reload_s {RELOAD_S:g} s: a token added answered in "
        f"{added:.2f} s, one removed refused in {removed:.2f} s; same ingress replica)",
        tried=2,
        failed=0,
        wrong=0,
        lost=0,
    )


def test_metrics_answer_the_scrape_token_which_rotates_too(services, secret_files) -> None:
    app, chat = services
    for target in (app, chat):  # both applications' /metrics
        for token in (None, ALICE, BOB):  # none, and tenants' tokens: not scrape tokens
            assert _status(target, "/metrics", token) == 401
    assert _status(app, "/metrics", SCRAPE) == 200
    _swap(secret_files["scrape"], SCRAPE_2)
    _until(app, "/metrics", SCRAPE_2, 200, RELOAD_S + 5)
    assert _status(app, "/metrics", SCRAPE) == 401
    _until(chat, "/metrics", SCRAPE_2, 200, RELOAD_S + 5)


ERIN_1 = "erin-token-first-0123456789ab"  # a tenant of the tokens file, rotated below
ERIN_2 = "erin-token-second-9876543210z"


def test_a_rotated_token_works_through_the_prefill_app_and_the_vllm_front(
    services, secret_files, serve_url
) -> None:
    """Tenant erin's token T1 replaced by T2 in the followed file, after both applications
    made erin's encoder client with T1: after reload_s, T2's chats with a new image are
    answered by the prefill application and forwarded by the vLLM front (the image encoded
    in erin's namespace), and T1's are refused 401 by both."""
    from ray import serve

    from tests.conftest import STOP_POLL_S
    from tests.deployments.test_vllm_front import FakeVllm
    from vitserve.deployments.runner.local import serve_app
    from vitserve.deployments.vllm.app import build_vllm_application

    encoder, chat = services
    gate = threading.Event()
    gate.set()
    fake = FakeVllm("erin", gate).start()
    name = "auth-front"
    cfg = VitserveConfig.load(
        {
            **encoder.config.model_dump(),
            "vllm": {
                "urls": [fake.url],
                "encoder_app": encoder.name,
                "num_cpus": 0.02,
                "graceful_shutdown_wait_loop_s": STOP_POLL_S,
            },
        }
    )
    serve_app(build_vllm_application(cfg), name=name, route_prefix=f"/{name}")
    front_url = f"{serve_url}/{name}"

    def body(image: bytes, model: str | None = None) -> dict[str, Any]:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        parts = [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        extra = {"model": model} if model else {}
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1, **extra}

    def ask(url: str, token: str, image: bytes, model: str | None = None) -> httpx.Response:
        return httpx.post(
            f"{url}/v1/chat/completions",
            json=body(image, model),
            headers=_headers(token),
            timeout=120,
        )

    seeds = iter(range(880_000, 890_000))
    try:
        _swap(secret_files["tokens"], f"erin:{ERIN_1}\n")
        _until(encoder, "/healthz", ERIN_1, 200, RELOAD_S + 5)
        time.sleep(RELOAD_S + 0.2)  # each application looks at the file on its next request
        first = ask(chat.url, ERIN_1, make_image(40, 40, seed=next(seeds)))
        assert first.status_code == 200, first.text
        forwarded = ask(front_url, ERIN_1, make_image(40, 40, seed=next(seeds)), "fake-vlm")
        assert forwarded.status_code == 200, forwarded.text

        _swap(secret_files["tokens"], f"erin:{ERIN_2}\n")
        _until(encoder, "/healthz", ERIN_1, 401, RELOAD_S + 5)
        time.sleep(RELOAD_S + 0.2)
        image = make_image(40, 40, seed=next(seeds))  # new: the encoder is called with a token
        answered = ask(chat.url, ERIN_2, image)
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["images_encoded"] == 1
        image = make_image(40, 40, seed=next(seeds))
        passed = ask(front_url, ERIN_2, image, "fake-vlm")
        assert passed.status_code == 200, passed.text
        namespace = httpx.get(f"{encoder.url}/healthz", headers=_headers(ERIN_2)).json()
        key = content_key(image, namespace["fingerprint"], namespace["namespace"])
        parts = fake.chats()[-1].json()["messages"][0]["content"]
        assert parts[1]["uuid"] == f"{namespace['namespace']}/{key}"  # in erin's namespace
        for url, model in ((chat.url, None), (front_url, "fake-vlm")):
            refused = ask(url, ERIN_1, make_image(40, 40, seed=next(seeds)), model)
            assert refused.status_code == 401, refused.text
    finally:
        _swap(secret_files["tokens"], "# erin left\n")
        serve.delete(name)
        fake.stop()


def test_vitserve_encode_takes_a_token_by_flag_or_environment(services, tmp_path) -> None:
    """``vitserve encode`` against a service with auth on: refused without a token (exit 1,
    the 401 said), encoded with ``--token``, and with ``$VITSERVE_TOKEN`` (then cached: the
    tenant's own entry)."""
    import subprocess

    from tests.cli_process import VITSERVE, cli_env

    encoder, _ = services
    image = tmp_path / "a.png"
    image.write_bytes(fresh_image())
    env = cli_env(tmp_path)

    def encode(*flags: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [VITSERVE, "encode", str(image), "--url", encoder.url, *flags],
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=120,
        )

    refused = encode()
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr, refused.stderr
    first = encode("--token", ALICE)
    assert first.returncode == 0 and first.stdout.endswith("\tencoded\n"), first.stderr
    again = encode(VITSERVE_TOKEN=ALICE)
    assert again.returncode == 0 and again.stdout.endswith("\tcached\n"), again.stderr
    assert again.stdout.split("\t")[1] == first.stdout.split("\t")[1]
