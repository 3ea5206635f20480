"""The HTTP answers both applications' routes share: the error shape and the metrics page."""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse, Response

from vitserve.deployments import metrics
from vitserve.errors import VitserveError

RETRY_AFTER_S = 1


def retry_headers(status: int) -> dict[str, str] | None:
    """``Retry-After`` on the answers a retry can help (429: at capacity, 503: unavailable)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None


def error_response(exc: VitserveError) -> JSONResponse:
    """``{"error": {"type", "message", ...fields}}`` with the error's status."""
    return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status,
                        headers=retry_headers(exc.http_status))  # fmt: skip


async def metrics_response() -> Response:
    """This node's ``vitserve_*`` metrics (Prometheus text), or the error of an endpoint that
    does not answer."""
    try:
        text = await metrics.node_page()
    except VitserveError as exc:
        return error_response(exc)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
