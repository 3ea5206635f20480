"""The prefill application: an OpenAI-style chat endpoint over the model's language model alone,
its own Serve application beside the encoder's (scaled, deployed and upgraded apart from it).

It is the working example of an LLM server using vitserve: images go to the encoder application
through the client SDK (hash first: only images the store lacks are uploaded), and each prefill
chunk pulls only the embedding rows it covers (see ``generation.py``). It never loads a vision
weight.

Routes (under the config's ``prefill.route_prefix``, default ``/prefill``):

* ``POST /v1/chat/completions``: OpenAI's chat completions, non-streaming and streaming (SSE);
  image parts as ``data:`` URLs or ``vitserve://<key>`` (see ``chat.py``); ``usage`` adds
  ``images_sent`` / ``images_uploaded`` / ``images_encoded``, ``rows_pulled``,
  ``bytes_pulled`` and ``prefill_chunks``. Errors have the encoder API's shape (``{"error":
  {"type", "message", ...}}``), with 503 + ``Retry-After`` when the encoder or the store cannot
  answer after the client's retries.
* ``GET /v1/models``: OpenAI's model list, the one served model (``prefill.served_model_name``,
  else ``model`` as configured; what requests name as ``model``).
* ``GET /healthz``: the model, the chunk size and where the encoder is reached.

With the config's ``auth`` on, the ``/v1`` routes need ``Authorization: Bearer <token>`` (401
otherwise), and the chat route calls the encoder with the caller's token, through one client
per tenant (made at its first request, kept): a chat sees only its tenant's images, so
another tenant's ``vitserve://<key>`` is a miss (404). ``/healthz`` and ``/metrics`` stay open.
* ``GET /metrics``: this node's ``vitserve_*`` metrics (both applications').

``serve run vitserve.deployments.prefill:build_app model=demo`` starts it alone (against a
running encoder application named by ``prefill.encoder_app``, or ``prefill.encoder_url``);
``vitserve serve --prefill`` runs both on the embedded default.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.concurrency import run_in_threadpool

from vitserve.deployments import metrics
from vitserve.deployments import requests as parse
from vitserve.deployments.auth import Authenticator, Tenant, bearer_token
from vitserve.deployments.config import EncoderAccessConfig, VitserveConfig
from vitserve.deployments.lifecycle import Draining
from vitserve.deployments.responses import (
    error_response,
    error_responses,
    install_error_handlers,
    metrics_response,
)
from vitserve.errors import ServiceUnavailableError, VitserveError

log = logging.getLogger("ray.serve")
INGRESS_DEPLOYMENT = "Ingress"  # the encoder application's ingress, reached by its handle

api = FastAPI(
    title="vitserve prefill",
    summary="Chat completions over a language model fed image embeddings from vitserve.",
    version="0.1.0",
)
install_error_handlers(api)  # every error answer in the encoder API's shape (responses.py)
api.add_middleware(Draining)  # graceful stop: drain, then 503 (lifecycle.py)


def make_client(cfg: VitserveConfig, token: str | None = None,
                section: EncoderAccessConfig | None = None) -> Any:  # fmt: skip
    """The client SDK as the prefill replicas (and the vLLM front's, with ``section=cfg.vllm``)
    use it: the encoder by handle (or URL), the store read directly (``section.store``, else
    ``store``) unless ``section.direct_store`` is off; ``token``: the bearer token it calls the
    encoder with (auth on). ``section``: ``cfg.prefill`` unless given."""
    from vitserve.client import EncoderClient, RetryPolicy

    p = cfg.prefill if section is None else section
    store = (p.store or cfg.store) if p.direct_store else None  # p.store: a read-only user
    retry = RetryPolicy(attempts=p.encoder_attempts, backoff_s=0.05, max_backoff_s=1.0,
                        max_retry_after_s=1.0)  # fmt: skip
    if p.encoder_url:
        return EncoderClient(p.encoder_url, store=store, token=token, retry=retry)
    from ray.serve.exceptions import RayServeException

    try:
        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=p.encoder_app)
    except (RayServeException, KeyError) as exc:  # the encoder app is not (yet) running
        raise ServiceUnavailableError(f"encoder application {p.encoder_app!r}", str(exc)) from None
    return EncoderClient(handle=handle, store=store, token=token, retry=retry)


class TenantClients:
    """The encoder clients of an application that calls the encoder for its callers (the
    prefill application, the vLLM front): one per tenant, made with the tenant's token at its
    first request and kept; with auth off, one client. Made lazily: the application may start
    before the encoder application does (its requests get 503 until then)."""

    def __init__(self, cfg: VitserveConfig, section: EncoderAccessConfig | None = None) -> None:
        self.cfg = cfg
        self.section = section
        self._lock = threading.Lock()
        self._clients: dict[str | None, Any] = {}  # tenant name (None: auth off) -> client

    def get(self, tenant: Tenant | None, token: str | None) -> Any:
        name = None if tenant is None else tenant.name
        with self._lock:
            client = self._clients.get(name)
            if client is None:
                client = make_client(self.cfg, token if name else None, section=self.section)
                self._clients[name] = client
            return client


@serve.deployment
@serve.ingress(api)
class PrefillServer:
    def __init__(self, config: dict[str, Any]) -> None:
        from vitserve.deployments.chat_service import ChatService

        self.cfg = VitserveConfig.model_validate(config)
        self.service = ChatService(self.cfg, client=None)  # each request passes its client
        self.clients = TenantClients(self.cfg)
        self.auth = Authenticator.from_config(self.cfg)  # None: auth off
        self.created = int(time.time())  # the model list's ``created``: when this replica began

    def _prepare(self, body: Any, tenant: Tenant | None, token: str | None) -> Any:
        return self.service.prepare(body, client=self.clients.get(tenant, token))

    @api.post("/v1/chat/completions", summary="OpenAI-style chat completion (stream or not)",
              responses=error_responses(400, 401, 404, 408, 413, 415, 422, 503))  # fmt: skip
    async def completions(self, request: Request) -> Response:
        try:
            token = bearer_token(request.headers.get("authorization"))
            tenant = None if self.auth is None else self.auth.tenant(token)  # before the body
            # refused while read past max_request_bytes or body_timeout_s; JSON nested too
            # deeply is a 422; parsed off the event loop (a chat's text may hold any value)
            parse.json_type(request.headers.get("content-type"))
            limits = self.cfg.limits
            raw = await parse.read_body(request, limits.max_request_bytes, limits.body_timeout_s)
            body = await run_in_threadpool(parse.json_body, raw)
            prepared = await run_in_threadpool(self._prepare, body, tenant, token)
        except VitserveError as exc:
            self._count(exc.http_status)
            return error_response(exc)
        self._count(200, prepared.usage)

        def generated(tokens: int) -> None:
            metrics.inc("prefill_tokens_total", tokens, kind="completion")

        if prepared.request.stream:
            return StreamingResponse(self.service.stream(prepared, generated),
                                     media_type="text/event-stream")  # fmt: skip
        answer = await run_in_threadpool(self.service.complete, prepared)
        generated(answer["usage"]["completion_tokens"])
        return JSONResponse(answer)

    @api.get("/v1/models", summary="The served model, as OpenAI's model list",
             responses=error_responses(401))  # fmt: skip
    async def models(self, request: Request) -> Response:
        if self.auth is not None:
            try:
                self.auth.tenant(bearer_token(request.headers.get("authorization")))
            except VitserveError as exc:
                return error_response(exc)
        model = {"id": self.service.model_name, "object": "model", "created": self.created,
                 "owned_by": "vitserve"}  # fmt: skip
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

    def load_report(self) -> dict[str, Any]:
        """What loading the language model read (by handle: no vision tensor among it)."""
        import dataclasses

        return dataclasses.asdict(self.service.loaded.report)

    @api.get("/healthz", summary="Liveness, the model and where the encoder is reached")
    async def healthz(self) -> Response:
        p = self.cfg.prefill
        return JSONResponse({"status": "ok", "model": self.service.model_name,
                             "family": self.service.config.model_type,
                             "chunk_size": p.chunk_size,
                             "encoder": p.encoder_url or f"app {p.encoder_app}",
                             "context_tokens": self.service.context})  # fmt: skip

    @api.get("/metrics", summary="This node's vitserve metrics (Prometheus text format)")
    async def metrics_page(self) -> Response:
        return await metrics_response()


def build_prefill_application(cfg: VitserveConfig) -> Any:
    """The bound prefill application for ``cfg`` (the model resolved as the encoder's is)."""
    from vitserve.deployments.app import check_model, deployment_options, resolve_model

    served = cfg.prefill.served_model_name or cfg.model  # before "demo" becomes a folder
    prefill = cfg.prefill.model_copy(update={"served_model_name": served})
    cfg = cfg.model_copy(update={"model": resolve_model(cfg.model), "prefill": prefill})
    check_model(cfg)  # an unloadable or unsupported model fails here, not in retried replicas
    return PrefillServer.options(**deployment_options(cfg.prefill)).bind(cfg.model_dump())


def build_app(args: Mapping[str, Any]) -> Any:
    """The prefill application from ``serve run``/YAML-style args (as ``app.build_app``)."""
    return build_prefill_application(VitserveConfig.load(args))


__all__ = [
    "PrefillServer",
    "TenantClients",
    "api",
    "build_app",
    "build_prefill_application",
    "make_client",
]
