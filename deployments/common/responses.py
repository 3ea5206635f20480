"""The HTTP answers both applications' routes share: the error shape, the handlers that give
every error answer that shape, and the metrics page.

Every error answer of the API (the ingress's, the prefill's, the vLLM front's) is ``{"error":
{"type", "message", "param", "code", ...fields}}`` (OpenAI's shape, vLLM's too; ``code`` the
status) with the error's status (:func:`install_error_handlers`): a
:class:`~vitserve.errors.VitserveError` a route raises, FastAPI's request validation (422
naming the parameter), Starlette's HTTP errors (404 unknown route, 405 wrong method) and, as the
last resort, any other exception (500 :class:`~vitserve.errors.InternalError`, logged with its
traceback; the replica keeps serving).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitserve.deployments.common import metrics
from vitserve.deployments.common.auth import ScrapeGate
from vitserve.errors import InternalError, MalformedRequestError, VitserveError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log
RETRY_AFTER_S = 1

# The error body in OpenAPI (``responses=error_responses(...)`` on a route).
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message", "code"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
            "additionalProperties": True,
        }
    },
}
_WHAT = {
    400: "bad request (a prompt too long for the model's context, ...)",
    401: "no bearer token, or an unknown one (auth on)",
    404: "not found (a missing key or route)",
    405: "method not allowed",
    408: "the request body did not arrive in time",
    413: "over a request limit",
    415: "unsupported content type",
    422: "malformed request",
    429: "at capacity; retry after Retry-After",
    503: "unavailable; retry after Retry-After",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route's error statuses, each in the error shape (a 422
    given here replaces FastAPI's default ``{"detail": [...]}`` schema)."""
    content = {"application/json": {"schema": ERROR_SCHEMA}}
    return {s: {"description": _WHAT.get(s, "error"), "content": content} for s in statuses}


def retry_headers(status: int) -> dict[str, str] | None:
    """``Retry-After`` on the answers a retry can help (429: at capacity, 503: unavailable)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None


def error_response(exc: VitserveError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": {"type", "message", "param", "code", ...fields}}`` with the error's status
    (OpenAI's error shape, vLLM's too, with vitserve's fields beside)."""
    challenge = getattr(exc, "challenge", None)  # a 401's WWW-Authenticate (auth.py)
    retry_after = getattr(exc, "retry_after_s", None)  # a quota's own (QuotaExceededError)
    headers = {
        **(retry_headers(exc.http_status) or {}),
        **({"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after else {}),
        **({"WWW-Authenticate": challenge} if challenge else {}),
        **(headers or {}),
    }
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status, headers=headers)


def _where(loc: tuple[Any, ...]) -> tuple[str, str]:
    """(``"query parameter 'end'"``, ``"end"``) of a validation error's location."""
    if not loc:
        return "the request", ""
    kind, name = str(loc[0]), ".".join(str(p) for p in loc[1:])
    if kind in ("query", "path", "header", "cookie"):
        return f"{kind} parameter {name!r}", name
    return (f"{kind} {name}" if name else kind), name


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [(*_where(tuple(e.get("loc", ()))), str(e.get("msg", ""))) for e in exc.errors()]
    message = "; ".join(f"{where}: {msg}" for where, _, msg in problems) or "invalid request"
    err = MalformedRequestError(message)
    err.parameter = problems[0][1] if problems else ""  # type: ignore[attr-defined]
    err.param = err.parameter or None  # type: ignore[attr-defined]  # OpenAI's name for it
    return error_response(err)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        reason = f"no such route: {where} (the API is described at /docs)"
    elif exc.status_code == 405:
        reason = f"method not allowed: {where}"
    else:
        reason = f"{exc.detail} ({where})"
    return error_response(MalformedRequestError(reason, exc.status_code), dict(exc.headers or {}))


async def _vitserve_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, VitserveError)
    return error_response(exc)


class LastResort:
    """ASGI middleware: an exception no route or handler answered becomes a 500 in the error
    shape (logged with its traceback) instead of the server's plain-text page; once a response
    has started (a stream) it can only be logged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception(
                "unexpected error answering %s %s", scope.get("method"), scope.get("path")
            )
            if not started:
                await error_response(InternalError(type(exc).__name__))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Give every error answer of ``app`` the API's one shape (see the module)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(VitserveError, _vitserve_error)
    app.add_middleware(LastResort)


#: how every app declares its ``/metrics`` route (``@api.get("/metrics", **METRICS_ROUTE)``)
METRICS_ROUTE: dict[str, Any] = {
    "summary": "This node's vitserve metrics (Prometheus text format)",
    "response_class": PlainTextResponse,
}


async def metrics_response(scrape: ScrapeGate, authorization: str | None) -> Response:
    """This node's ``vitserve_*`` metrics (Prometheus text) for a caller ``scrape`` lets in
    (everyone with auth off; the scrape token's holder with it on: 401 otherwise), or the error
    of an endpoint that does not answer."""
    try:
        scrape.check(authorization)
        text = await metrics.node_page()
    except VitserveError as exc:
        return error_response(exc)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
