"""The prefill application: an OpenAI-style chat endpoint over the model's language model alone,
its own Serve application beside the encoder's (scaled, deployed and upgraded apart from it).

It is the working example of an LLM server using vitserve: images go to the encoder application
through the client SDK (hash first: only images the store lacks are uploaded), and each prefill
chunk pulls only the embedding rows it covers (see ``generation.py``). It never loads a vision
weight.

Routes (under the config's ``prefill.route_prefix``, default ``/prefill``):

* ``POST /v1/chat/completions``: OpenAI's chat completions, non-streaming and streaming (SSE);
  image parts as ``data:`` URLs or ``vitserve://<key>`` (see ``chat.py``); vLLM's
  ``min_tokens`` (end tokens held back), ``return_token_ids`` and ``skip_special_tokens`` too;
  ``usage`` adds
  ``images_sent`` / ``images_uploaded`` / ``images_encoded``, ``rows_pulled``,
  ``bytes_pulled`` and ``prefill_chunks``. Errors have the encoder API's shape (``{"error":
  {"type", "message", ...}}``), with 503 + ``Retry-After`` when the encoder or the store cannot
  answer after the client's retries.
* ``GET /v1/models``: OpenAI's model list, the one served model (``prefill.served_model_name``,
  else ``model`` as configured; what requests name as ``model``).
* ``GET /healthz``: the model, the chunk size and how the encoder is reached (an application
  by name, or a URL it does not show).

With the config's ``auth`` on, the ``/v1`` routes need ``Authorization: Bearer <token>`` (401
otherwise), and the chat route calls the encoder with the caller's token, through one client
per tenant (made at its first request, kept): a chat sees only its tenant's images, so
another tenant's ``vitserve://<key>`` is a miss (404). ``/healthz`` stays open; ``/metrics``
answers the scrape token alone (``auth.scrape_token``).
* ``GET /metrics``: this node's ``vitserve_*`` metrics (both applications').

``serve run vitserve.deployments.prefill.app:build_app model=demo`` starts it alone (against a
running encoder application named by ``prefill.encoder_app``, or ``prefill.encoder_url``);
``vitserve serve --prefill`` runs both on the embedded default.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.concurrency import run_in_threadpool

from vitserve.deployments.common import metrics
from vitserve.deployments.common import requests as parse
from vitserve.deployments.common.auth import Gate, Tenant, bearer_token
from vitserve.deployments.common.clients import TenantClients
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.common.lifecycle import Draining
from vitserve.deployments.common.responses import (
    METRICS_ROUTE,
    error_response,
    error_responses,
    install_error_handlers,
    metrics_response,
)
from vitserve.deployments.common.serving import (
    as_deployment,
    check_model,
    deployment_options,
    resolve_model,
)
from vitserve.deployments.prefill.chat import ChatRequest
from vitserve.errors import VitserveError

log = logging.getLogger("ray.serve")

api = FastAPI(
    title="vitserve prefill",
    summary="Chat completions over a language model fed image embeddings from vitserve.",
    version="0.1.0",
)
install_error_handlers(api)  # every error answer in the encoder API's shape (responses.py)
api.add_middleware(Draining)  # graceful stop: drain, then 503 (lifecycle.py)


@serve.deployment
@serve.ingress(api)
class PrefillServer:
    def __init__(self, config: dict[str, Any]) -> None:
        # heavy (torch, transformers): the driver imports this module to bind the app; only a
        # replica builds the chat service
        from vitserve.deployments.prefill.chat_service import ChatService

        self.cfg = VitserveConfig.model_validate(config)
        self.service = ChatService(self.cfg, client=None)  # each request passes its client
        self.clients = TenantClients(self.cfg)
        self.gate = Gate(self.cfg)  # who calls (None: auth off), within the tenant's rate
        self.created = int(time.time())  # the model list's ``created``: when this replica began

    def _prepare(self, body: Any, tenant: Tenant | None, token: str | None) -> Any:
        return self.service.prepare(body, client=self.clients.get(tenant, token))

    @api.post(
        "/v1/chat/completions",
        summary="OpenAI-style chat completion (stream or not)",
        openapi_extra=parse.body_openapi(parse.inlined_schema(ChatRequest.model_json_schema())),
        responses=error_responses(400, 401, 404, 408, 413, 415, 422, 429, 503),
    )
    async def completions(self, request: Request) -> Response:
        try:
            token = bearer_token(request.headers.get("authorization"))
            tenant = self.gate.caller(token)  # before the body
            # refused while read past max_request_bytes or body_timeout_s; JSON nested too
            # deeply is a 422; parsed off the event loop (a chat's text may hold any value)
            parse.json_type(request.headers.get("content-type"))
            limits = self.cfg.limits
            raw = await parse.read_body(request, limits.max_request_bytes, limits.body_timeout_s)
            # its values counted before it is parsed (413 json_values)
            body = await run_in_threadpool(parse.json_body, raw, limits.max_chat_json_values)
            prepared = await run_in_threadpool(self._prepare, body, tenant, token)
        except VitserveError as exc:
            self._count(exc.http_status)
            return error_response(exc)
        self._count(200, prepared.usage)

        def generated(tokens: int) -> None:
            metrics.inc("prefill_tokens_total", tokens, kind="completion")

        if prepared.request.stream:
            return StreamingResponse(
                self.service.stream(prepared, generated), media_type="text/event-stream"
            )
        answer = await run_in_threadpool(self.service.complete, prepared)
        generated(answer["usage"]["completion_tokens"])
        return JSONResponse(answer)

    @api.get(
        "/v1/models",
        summary="The served model, as OpenAI's model list",
        responses=error_responses(401, 429),
    )
    async def models(self, request: Request) -> Response:
        try:
            self.gate.caller(bearer_token(request.headers.get("authorization")))
        except VitserveError as exc:
            return error_response(exc)
        model = {
            "id": self.service.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vitserve",
        }
        return JSONResponse({"object": "list", "data": [model]})

    def _count(self, status: int, usage: Mapping[str, int] | None = None) -> None:
        metrics.inc("requests_total", route="chat", status=str(status))
        if usage is None:
            return
        for kind in ("sent", "uploaded", "encoded"):
            metrics.inc("prefill_images_total", usage[f"images_{kind}"], kind=kind)
        metrics.inc("prefill_rows_pulled_total", usage["rows_pulled"])
        metrics.inc("prefill_bytes_pulled_total", usage["bytes_pulled"])
        metrics.inc("prefill_chunks_total", usage["prefill_chunks"])
        metrics.inc("prefill_tokens_total", usage["prompt_tokens"], kind="prompt")

    def counts(self) -> metrics.Counts:
        """By handle: this replica's metric counters, exact at once (``/metrics`` lags)."""
        return metrics.counts()

    def load_report(self) -> dict[str, Any]:
        """What loading the language model read (by handle: no vision tensor among it)."""
        return dataclasses.asdict(self.service.loaded.report)

    @api.get("/healthz", summary="Liveness, the model and where the encoder is reached")
    async def healthz(self) -> Response:
        p = self.cfg.prefill
        return JSONResponse(
            {
                "status": "ok",
                "model": self.service.model_name,
                "family": self.service.config.model_type,
                "chunk_size": p.chunk_size,
                # how, not where: no internal address in an answer
                "encoder": "by URL" if p.encoder_url else f"app {p.encoder_app}",
                "context_tokens": self.service.context,
            }
        )

    @api.get("/metrics", **METRICS_ROUTE)
    async def metrics_page(self, request: Request) -> Response:
        return await metrics_response(self.gate.scrape, request.headers.get("authorization"))


def build_prefill_application(cfg: VitserveConfig) -> Any:
    """The bound prefill application for ``cfg`` (the model resolved as the encoder's is)."""
    served = cfg.prefill.served_model_name or cfg.model  # before "demo" becomes a folder
    prefill = cfg.prefill.model_copy(update={"served_model_name": served})
    cfg = cfg.model_copy(update={"model": resolve_model(cfg.model), "prefill": prefill})
    check_model(cfg)  # an unloadable or unsupported model fails here, not in retried replicas
    return (
        as_deployment(PrefillServer)
        .options(**deployment_options(cfg.prefill))
        .bind(cfg.model_dump())
    )


def build_app(args: Mapping[str, Any]) -> Any:
    """The prefill application from ``serve run``/YAML-style args (as ``app.build_app``)."""
    return build_prefill_application(VitserveConfig.load(args))


__all__ = [
    "PrefillServer",
    "api",
    "build_app",
    "build_prefill_application",
]
