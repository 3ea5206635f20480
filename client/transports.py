"""How the clients reach the service: HTTP to the ingress, or the ingress's Serve handle.

Each transport turns an :class:`~vitserve.client.core.ApiCall` into a
:class:`~vitserve.client.core.Reply` (a list of them for ``rows``). Transport failures become
:class:`~vitserve.errors.ServiceUnavailableError` (retryable: a refused or dropped connection,
a timeout) so the caller catches one root; error answers are returned as replies for the core
to read. A bearer ``token`` (the service's auth) goes with every call: the ``Authorization``
header over HTTP, the ``token`` argument of ``Ingress.call`` through a handle.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

import httpx

from vitserve.cache.codec import unpack_records
from vitserve.client.core import ApiCall, Reply, retry_after_seconds
from vitserve.errors import ConfigError, ServiceUnavailableError, actor_unavailable_errors

# httpx's errors that a retry can help: the connection failed, dropped or timed out
_RETRYABLE = (httpx.TransportError,)

Answer = tuple[int, Any]  # Ingress.call's (status, JSON body)


class IngressResponse(Protocol):
    """A Serve ``DeploymentResponse`` of ``Ingress.call``: waited on (``.result()``) by the
    blocking client, awaited by the async one."""

    def result(self) -> Answer: ...
    def __await__(self) -> Generator[Any, None, Answer]: ...


class IngressCall(Protocol):
    def remote(self, route: str, payload: Any, **kwargs: Any) -> IngressResponse: ...


class IngressHandle(Protocol):
    """The ingress deployment's Serve ``DeploymentHandle``, as the handle transports call it
    (``Ingress.call``)."""

    @property
    def call(self) -> IngressCall: ...


H = TypeVar("H")
B = TypeVar("B")


def pick_transport(
    url: str | None,
    handle: IngressHandle | None,
    over_http: Callable[[str], H],
    by_handle: Callable[[IngressHandle], B],
) -> H | B:
    """A client's transport: ``by_handle(handle)`` when given the ingress handle, else
    ``over_http(url)`` (``ClientCore.for_client`` checked that exactly one is given)."""
    if handle is not None:
        return by_handle(handle)
    assert url is not None
    return over_http(url)


def _unavailable(exc: Exception, where: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(where, f"{type(exc).__name__}: {exc}")


def _reply(response: httpx.Response) -> Reply:
    ctype = response.headers.get("content-type", "")
    body: Any = response.content
    if ctype.startswith("application/json"):
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"type": "ApiError", "message": response.text[:200]}}
    elif response.status_code != 200:
        body = {"unexpected": response.text[:200]}
    return Reply(
        response.status_code, body, retry_after_seconds(response.headers.get("retry-after"))
    )


def _request(call: ApiCall) -> dict[str, Any]:
    """The httpx request arguments of a call (not ``rows``)."""
    if call.route == "healthz":
        return {"method": "GET", "url": "/healthz"}
    if call.route == "probe":
        return {"method": "POST", "url": "/v1/probe", "json": call.payload}
    if call.route == "encode":
        files = [
            (field, (f"{i}", data, "application/octet-stream"))
            for field in ("images", "videos")
            for i, data in enumerate(call.payload.get(field, ()))
        ]
        asked = {k: call.payload[k] for k in ("wait", "video_for") if k in call.payload}
        params = asked or None
        return {"method": "POST", "url": "/v1/encode", "files": files, "params": params}
    raise ConfigError(f"unknown API route {call.route!r}")


def _auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _rows_request(call: ApiCall) -> dict[str, Any]:
    return {"method": "POST", "url": "/v1/rows", "json": {"reads": [list(r) for r in call.payload]}}


def _rows_replies(response: httpx.Response) -> Reply | list[Reply]:
    """``/v1/rows``' bundle as one reply per read (404: missing), or its error reply."""
    if response.status_code != 200:
        return _reply(response)
    return [
        Reply(404, None) if r is None else Reply(200, r) for r in unpack_records(response.content)
    ]


class HttpTransport:
    """Blocking HTTP to the ingress at ``url`` (one pooled httpx.Client)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        client: httpx.Client | None = None,
        token: str | None = None,
    ) -> None:
        self.where = f"ingress {url}"
        self.client = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self.headers = _auth_headers(token)

    def use_token(self, token: str | None) -> None:
        """Send ``token`` from the next call on (a rotated token of the same tenant)."""
        self.headers = _auth_headers(token)  # one assignment: a call sees the old or the new

    def call(self, call: ApiCall) -> Reply | list[Reply]:
        try:
            if call.route == "rows":
                return _rows_replies(
                    self.client.request(**_rows_request(call), headers=self.headers)
                )
            return _reply(self.client.request(**_request(call), headers=self.headers))
        except _RETRYABLE as exc:
            raise _unavailable(exc, self.where) from exc

    def close(self) -> None:
        self.client.close()


class AsyncHttpTransport:
    """HTTP to the ingress with httpx.AsyncClient."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
        token: str | None = None,
    ) -> None:
        self.where = f"ingress {url}"
        self.client = client or httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s)
        self.headers = _auth_headers(token)

    def use_token(self, token: str | None) -> None:
        """Send ``token`` from the next call on (a rotated token of the same tenant)."""
        self.headers = _auth_headers(token)  # one assignment: a call sees the old or the new

    async def call(self, call: ApiCall) -> Reply | list[Reply]:
        try:
            if call.route == "rows":
                return _rows_replies(
                    await self.client.request(**_rows_request(call), headers=self.headers)
                )
            return _reply(await self.client.request(**_request(call), headers=self.headers))
        except _RETRYABLE as exc:
            raise _unavailable(exc, self.where) from exc

    async def close(self) -> None:
        await self.client.aclose()


def _handle_reply(answer: Answer) -> Reply | list[Reply]:
    status, body = answer
    if status == 200 and isinstance(body, dict) and "records" in body:
        return [Reply(404, None) if r is None else Reply(200, r) for r in body["records"]]
    return Reply(status, body)  # no Retry-After on a handle: the retry policy's backoff


def _handle_payload(call: ApiCall) -> Any:
    return {"reads": [list(r) for r in call.payload]} if call.route == "rows" else call.payload


class HandleTransport:
    """The ingress's Serve ``DeploymentHandle``, for callers inside the Ray cluster: no HTTP
    proxy; ``Ingress.call`` answers as the HTTP routes do (and checks ``token`` as they
    check the bearer header)."""

    def __init__(self, handle: IngressHandle, token: str | None = None) -> None:
        self.handle = handle
        self.where = f"ingress handle {getattr(handle, 'deployment_name', '?')}"
        self.kwargs = {"token": token} if token else {}

    def use_token(self, token: str | None) -> None:
        """Send ``token`` from the next call on (a rotated token of the same tenant)."""
        self.kwargs = {"token": token} if token else {}

    def call(self, call: ApiCall) -> Reply | list[Reply]:
        try:
            return _handle_reply(
                self.handle.call.remote(call.route, _handle_payload(call), **self.kwargs).result()
            )
        except actor_unavailable_errors() as exc:
            raise _unavailable(exc, self.where) from exc

    def close(self) -> None:
        pass


class AsyncHandleTransport(HandleTransport):
    """The handle transport for the async client (awaits the handle's responses)."""

    async def call(self, call: ApiCall) -> Reply | list[Reply]:  # type: ignore[override]
        try:
            return _handle_reply(
                await self.handle.call.remote(call.route, _handle_payload(call), **self.kwargs)
            )
        except actor_unavailable_errors() as exc:
            raise _unavailable(exc, self.where) from exc

    async def close(self) -> None:  # type: ignore[override]
        pass


__all__ = ["AsyncHandleTransport", "AsyncHttpTransport", "HandleTransport", "HttpTransport"]
