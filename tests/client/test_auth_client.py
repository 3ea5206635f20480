"""The SDK's bearer-token plumbing, fast and without a service (the real service's auth is
tested in tests/deployments/test_auth.py): every call of both HTTP transports carries the
token, the handle transport passes it to ``Ingress.call``, and a service that wants a token
is reported as an AuthenticationError, never as a model without a fingerprint."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from vitserve.cache.codec import pack_records
from vitserve.client.core import ApiCall, ClientCore, Reply
from vitserve.client.transports import (
    AsyncHandleTransport,
    AsyncHttpTransport,
    HandleTransport,
    HttpTransport,
)
from vitserve.errors import AuthenticationError

TOKEN = "tenant-token-0123456789abcdef"
CALLS = [
    ApiCall("healthz"),
    ApiCall("probe", {"keys": ["0" * 64]}),
    ApiCall("encode", {"images": [b"\x89PNG"]}),
    ApiCall("rows", [("0" * 64, 0, 1)]),
]


def _recording(seen: list[str | None]) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.url.path == "/v1/rows":
            return httpx.Response(200, content=pack_records([None]))
        return httpx.Response(200, json={"ok": True})

    return httpx.MockTransport(answer)


@pytest.mark.parametrize("token", [TOKEN, None])
def test_every_http_call_carries_the_token(token: str | None) -> None:
    seen: list[str | None] = []
    client = httpx.Client(base_url="http://svc", transport=_recording(seen))
    transport = HttpTransport("http://svc", client=client, token=token)
    for call in CALLS:
        transport.call(call)
    want = f"Bearer {TOKEN}" if token else None
    assert seen == [want] * len(CALLS)

    seen.clear()
    aclient = httpx.AsyncClient(base_url="http://svc", transport=_recording(seen))
    atransport = AsyncHttpTransport("http://svc", client=aclient, token=token)

    async def run() -> None:
        for call in CALLS:
            await atransport.call(call)
        await atransport.close()

    asyncio.run(run())
    assert seen == [want] * len(CALLS)


class _Handle:
    """Stands in for the ingress's DeploymentHandle: records ``call.remote``'s arguments."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.call = self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append((args, kwargs))
        answer = (200, {"ok": True})

        class Response:
            def result(self) -> Any:
                return answer

            def __await__(self) -> Any:
                async def done() -> Any:
                    return answer

                return done().__await__()

        return Response()


def test_the_handle_transport_passes_the_token_to_ingress_call() -> None:
    handle = _Handle()
    HandleTransport(handle, TOKEN).call(ApiCall("probe", {"keys": []}))
    asyncio.run(AsyncHandleTransport(handle, TOKEN).call(ApiCall("healthz")))
    HandleTransport(handle).call(ApiCall("healthz"))  # no token: the call an older ingress takes
    assert [kw for _, kw in handle.seen] == [{"token": TOKEN}, {"token": TOKEN}, {}]
    assert handle.seen[0][0] == ("probe", {"keys": []})


def _describe(answer: Reply) -> Any:
    core = ClientCore()
    flow = core.describe()
    assert next(flow) == ApiCall("healthz")
    try:
        flow.send(answer)
    except StopIteration as done:
        return done.value
    raise AssertionError("describe asked for more than healthz")


def test_a_service_that_wants_a_token_is_an_authentication_error() -> None:
    # a client without a token gets liveness only: it must not key images without a namespace
    with pytest.raises(AuthenticationError, match="token") as missing:
        _describe(Reply(200, {"status": "ok", "auth": "bearer"}))
    assert missing.value.reason == "missing" and not missing.value.retryable
    # a wrong token: the service's 401 as the same class, fields kept
    body = {
        "error": {
            "type": "AuthenticationError",
            "message": "the bearer token is not valid here",
            "reason": "invalid",
        }
    }
    with pytest.raises(AuthenticationError) as wrong:
        _describe(Reply(401, body))
    assert wrong.value.reason == "invalid" and wrong.value.http_status == 401
    model = {"status": "ok", "fingerprint": "f" * 64, "namespace": "p.alice", "tenant": "alice"}
    assert _describe(Reply(200, model))["namespace"] == "p.alice"
