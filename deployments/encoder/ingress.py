"""The HTTP ingress: FastAPI under ``@serve.ingress``; OpenAPI at ``/docs``; all on one port.

Routes:

* ``POST /v1/encode``: images as repeated multipart fields ``images``, or JSON
  ``{"images": [{"data": "<base64>"} | {"key": "<hex>"}]}`` (a key-only item names an image the
  caller believes cached). Answer: ``{"items": [...]}`` in input order, each
  ``{key, num_tokens, grid, dtype, shape, extras, cached}`` or ``{error}``. With
  ``?wait=claimed`` it answers once the new images are claimed, each new one
  ``{key, pending: true}``, and encodes and publishes them after (``encode_flow``).
* ``POST /v1/probe``: ``{"keys": [...]}`` -> ``{"exists": [bool, ...]}``; with ``"headers":
  true`` also ``"items"``, each held key's description (as an encode item) or null.
* ``GET /v1/embeddings/{key}[?start=&end=]``: the record (``application/octet-stream``, the
  store's record format); with a row range, a record of just those rows, whose first row is
  row ``X-Vitserve-Row-Start`` of the image's ``X-Vitserve-Num-Tokens``.
* ``POST /v1/rows``: ``{"reads": [[key, start, end], ...]}`` -> the row records of every
  read in one body (``application/x-vitserve-records``, see ``cache.codec.pack_records``; a
  missing key has length 0), read in one batched store call.
* ``GET /healthz``, ``GET /metrics`` (this node's ``vitserve_*`` metrics, Prometheus text).
* ``GET /v1/stats`` (with auth on: the scrape token, as ``/metrics``; the counters are every
  tenant's): the counters this ingress replica and the encoder replica the call
  reached have incremented, exact at once (``/metrics`` lags Ray's export by a second or
  more): ``{"ingress": {"replica", "counts"}, "encoder": {"replica", "images",
  "forward_calls", ..., "counts"}}``, each ``counts`` a list of ``{name, tags, value}``. With
  several replicas each call reaches one of each; the ``replica`` fields say which.

Callers inside the Ray cluster reach the same answers through the deployment's handle:
``Ingress.call(route, payload, token)`` (the client SDK's handle transport).

With the config's ``auth`` on, the ``/v1`` routes (and ``call``) need a bearer token and serve
the token's tenant from its own namespace only; ``/healthz`` answers liveness without one and
the caller's namespace with one; ``/metrics`` answers the scrape token alone (see
``vitserve.deployments.common.auth``).

Every error answer has one shape, ``{"error": {"type", "message", "param", "code", ...}}``
(FastAPI's validation errors, unknown routes and wrong methods included: ``responses.py``).
Requests are
read by ``requests.py``: a body is refused while it is read once it passes
``max_request_bytes`` (chunked or declared; a probe or rows body, 4 KiB a key or read) or
``body_timeout_s`` (408), a JSON route takes JSON (415 otherwise), an empty body, invalid or
too deeply nested JSON, a key that is not 64 lowercase hex characters or a row range that is
not ``0 <= start < end`` (integers) is a 422 naming it. Bodies are parsed, and images' headers
and keys read, in two threads of the ingress's own (``bodies.py``), in steps that never hold
the interpreter lock for long: ``/healthz`` answers meanwhile.

Request-level limits are checked before any work, from the request's size and each image's
header: too many images (counted before any base64 is decoded), too many bytes, an image over
``max_image_bytes`` or ``max_image_pixels`` (a decompression bomb), more work than one encoder
replica admits (``encoder_max_patches`` / ``encoder_max_bytes``, from the images' headers by
the encoder's :class:`~vitserve.encoder.work.Terms`), a ``/v1/rows`` answer over
``max_rows_bytes`` -> 413 with a JSON error naming the limit; the request then costs nothing
else. Images that pass the limits but do not decode or preprocess fail alone: their item
carries the error, the others are encoded. An encoder whose admitted work leaves no room, or
a full encoder queue -> 429 with ``Retry-After``. A store that is down -> 503 for fetches and
probes, while encodes still answer (from a tiered store's local tier, or by encoding). An
encoder that cannot describe its model yet (starting) -> 503.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations
# (``Request``) at run time inside Serve's class-based ingress.
import asyncio
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from vitserve.cache import open_connection
from vitserve.cache.base import EmbeddingStore
from vitserve.cache.codec import EmbeddingRecord, encode_record, pack_records
from vitserve.cache.views import StoreViews
from vitserve.client.handles import EncodeWait
from vitserve.deployments.common import metrics
from vitserve.deployments.common import requests as parse
from vitserve.deployments.common.auth import Gate, Tenant, bearer_token
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.common.lifecycle import Draining
from vitserve.deployments.common.responses import (
    METRICS_ROUTE,
    error_response,
    error_responses,
    install_error_handlers,
    metrics_response,
    retry_headers,
)
from vitserve.deployments.encoder.bodies import BodyReader, encode_video_for, encode_wait
from vitserve.deployments.encoder.encode_flow import EncodeFlow, EncoderHandle, PreprocessHandle
from vitserve.deployments.encoder.preprocessing import make_preprocessor
from vitserve.deployments.encoder.wire import describe_header, with_cached
from vitserve.encoder.work import Terms
from vitserve.errors import (
    CacheMissError,
    ConfigError,
    LimitExceededError,
    MalformedRequestError,
    ServiceUnavailableError,
    VitserveError,
)
from vitserve.keys import item_key, video_settings
from vitserve.media import VideoFor

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

api = FastAPI(
    title="vitserve",
    summary="Disaggregated vision encoder: encode images once, fetch embeddings by key.",
    version="0.1.0",
)
install_error_handlers(api)  # every error answer in the one shape (responses.py)
api.add_middleware(Draining)  # graceful stop: drain, then 503 (lifecycle.py)


def _rows_record(part: Any) -> Any:
    """A row-range read as a record of just those rows (what the row routes answer)."""
    return EmbeddingRecord(
        key=part.key,
        fingerprint=part.fingerprint,
        dtype=part.dtype,
        num_tokens=len(part.embedding),
        grid=part.grid,
        tensors=part.tensors,
    )


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(
        self,
        encoder: EncoderHandle,
        preprocess: PreprocessHandle | None,
        config: dict[str, Any],
    ) -> None:
        """``preprocess``: the preprocess deployment's handle, or None unless the config's
        ``preprocess_at`` is ``deployment``."""
        self.cfg = VitserveConfig.model_validate(config)
        self.encoder = encoder
        # One store connection for every namespace (the config's, or with auth on each
        # tenant's), with a store over it per namespace. Those that read records check the
        # model's fingerprint: they are made once the encoder has described the model
        # (``_fetch_model``). Until then only exists probes are answered, which read no record:
        # by stores that check no fingerprint, counting with the others.
        connection, policy = open_connection(self.cfg.store)
        self._unchecked = StoreViews(connection, policy, owns_connection=True)
        self._stores: StoreViews | None = None
        self.gate = Gate(self.cfg)  # who calls, and so their namespace
        preprocessor = None
        if self.cfg.preprocess_at == "ingress":
            # heavy (torch): only an ingress that preprocesses loads it
            from vitserve.encoder.device import tune_cpu_allocator

            tune_cpu_allocator()  # see WORKER_ENV in vitserve.deployments.common.serving
            preprocessor = make_preprocessor(self.cfg)
        # no store of its own: each request's is its tenant's (``_store_for``)
        self.flow = EncodeFlow(self.cfg, None, encoder, preprocess, preprocessor)
        self._model: dict[str, Any] | None = None
        self._terms: Terms | None = None
        self._describing: asyncio.Future | None = None
        # Reading a request's items (JSON, base64, image headers, content keys: up to
        # max_request_bytes of CPU work), off the event loop (bodies.py).
        self.bodies = BodyReader(self.cfg.limits)

    async def _describe(self) -> dict[str, Any]:
        """The encoder's model and its work terms, fetched once (concurrent first requests
        share one fetch); a 503 (retryable) while the encoder cannot answer (starting, or
        gone), and the next request asks again."""
        if self._model is None:
            if self._describing is None or self._describing.done():
                self._describing = asyncio.ensure_future(self._fetch_model())
            try:
                await asyncio.shield(self._describing)
            except Exception as exc:  # Ray's and Serve's errors for an encoder not there
                raise ServiceUnavailableError(
                    "encoder", f"cannot describe the model: {type(exc).__name__}"
                ) from None
        assert self._model is not None
        return self._model

    async def _fetch_model(self) -> None:
        model = await self.encoder.describe.remote()
        terms = await self.encoder.work_terms.remote()
        if self._stores is None:
            unchecked = self._unchecked
            self._stores = StoreViews(
                unchecked.connection,
                dataclasses.replace(unchecked.policy, fingerprint=model["fingerprint"]),
                counters=unchecked.counters,
            )
        self._terms, self._model = terms, model

    def _store_for(self, tenant: Tenant) -> EmbeddingStore:
        """The store of ``tenant``'s namespace, checking the model's fingerprint (once
        ``_describe`` has answered)."""
        assert self._stores is not None, "the model is described first"
        return self._stores.get(tenant.namespace)

    async def _work_terms(self) -> Terms:
        await self._describe()
        assert self._terms is not None
        return self._terms

    # -- encode ------------------------------------------------------------------------------
    @api.post(
        "/v1/encode",
        summary="Encode images (multipart or JSON); items in input order",
        openapi_extra=parse.ENCODE_OPENAPI,
        responses=error_responses(401, 408, 413, 415, 422, 429, 503),
    )
    async def encode(self, request: Request) -> Response:
        try:
            tenant = self.gate.tenant_of_header(request.headers.get("authorization"))
            terms = await self._work_terms()
            wait = encode_wait(request.query_params.get("wait"))
            video_for = encode_video_for(request.query_params.get("video_for"))
            items, patches = await self.bodies.read(request, terms, wait, video_for)
            response = JSONResponse(
                await self._encode_answer(items, tenant, patches, wait, video_for)
            )
        except VitserveError as exc:
            response = error_response(exc)
        metrics.inc("requests_total", route="encode", status=str(response.status_code))
        return response

    async def _encode_answer(
        self,
        items: list[bytes | str],
        tenant: Tenant,
        patches: list[int],
        wait: EncodeWait = EncodeWait.PUBLISHED,
        video_for: VideoFor = VideoFor.MODEL,
    ) -> dict[str, Any]:
        model = await self._describe()

        def keys() -> list[str]:  # hashing up to max_request_bytes: off the loop
            fingerprint, video = model["fingerprint"], video_settings(model, video_for)
            return [
                i if isinstance(i, str) else item_key(i, fingerprint, tenant.namespace, video)
                for i in items
            ]

        store = self._store_for(tenant)
        keyed = await self.bodies.off_loop(keys)
        answer = await self.flow.encode(items, keyed, store, patches, wait, video_for)
        return {"items": answer}

    # -- probe and fetch -------------------------------------------------------------------------
    @api.post(
        "/v1/probe",
        summary="Which keys the store holds (and, asked, their headers)",
        openapi_extra=parse.PROBE_OPENAPI,
        responses=error_responses(401, 408, 413, 415, 422, 429, 503),
    )
    async def probe(self, request: Request) -> Response:
        return await self._json_route(request, "probe", self._probe)

    async def _json_route(
        self, request: Request, route: str, work: Any, answer: Any = None
    ) -> Response:
        """A route whose request is JSON: ``work(doc, tenant)``'s answer (as JSON, or as
        ``answer(body)`` makes it), or its error (``Retry-After`` where a retry can help);
        counted in ``requests_total``. The caller is authenticated before the body is read;
        the body is refused while it is read once it passes ``max_request_bytes`` or 4 KiB a
        key or read (``json_body_bytes``), or ``body_timeout_s``, and parsed off the event
        loop."""
        try:
            tenant = self.gate.tenant_of_header(request.headers.get("authorization"))
            parse.json_type(request.headers.get("content-type"))
            limits = self.cfg.limits
            # a probe or a rows read is small (~80 bytes a key or read): its body is read up
            # to what its most keys may take, when that is less than max_request_bytes
            allowed, name = limits.max_request_bytes, "max_request_bytes"
            if (json_limit := parse.json_body_limit(limits.max_keys_per_probe)) < allowed:
                allowed, name = json_limit, "json_body_bytes"
            body = await parse.read_body(request, allowed, limits.body_timeout_s, name=name)
            doc = await self.bodies.off_loop(
                parse.json_body, body, parse.json_values_allowed(limits.max_keys_per_probe)
            )
        except VitserveError as exc:
            response = error_response(exc)
        else:
            status, reply = await self._answer(work(doc, tenant))
            if status == 200 and answer is not None:
                response = answer(reply)
            else:
                response = JSONResponse(reply, status_code=status, headers=retry_headers(status))
        metrics.inc("requests_total", route=route, status=str(response.status_code))
        return response

    async def _probe(self, doc: Any, tenant: Tenant) -> dict[str, Any]:
        """``{"keys": [...], "headers": false}`` -> ``{"exists": [...]}``; with ``"headers":
        true`` also ``"items"``: each held key's description (as an encode item, ``cached:
        true``) or null, read in the same store round trip."""
        keys, with_headers = parse.probe(doc, self.cfg.limits.max_keys_per_probe)
        if not with_headers:  # reads no record: answered before the model is known
            store = self._unchecked.get(tenant.namespace)
            with metrics.timed("store_round_trip_seconds", op="exists"):
                return {"exists": await asyncio.to_thread(store.exists_many, keys)}
        await self._describe()  # the store checks each header's fingerprint
        store = self._store_for(tenant)
        with metrics.timed("store_round_trip_seconds", op="headers"):
            headers = await asyncio.to_thread(store.headers_many, keys)
        items = [None if h is None else with_cached(describe_header(h), True) for h in headers]
        return {"exists": [h is not None for h in headers], "items": items}

    async def _answer(self, work: Any) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)`` of a route's work: its answer, or its error's."""
        try:
            return 200, await work
        except VitserveError as exc:
            return exc.http_status, {"error": exc.to_dict()}

    # -- callers inside the Ray cluster ------------------------------------------------------------
    async def call(
        self, route: str, payload: dict[str, Any], token: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The API for a caller holding this deployment's handle (the client SDK inside the
        cluster): the same answers as the HTTP routes, as ``(status, JSON body)``, without the
        HTTP proxy, authorized the same way (``token``: the bearer token). ``route``:
        ``healthz`` (no payload), ``probe`` (the JSON of ``/v1/probe``), ``encode``
        (``{"images": [bytes | 64-hex key, ...]}``, the limits of ``/v1/encode`` checked the
        same way), ``rows`` (``{"reads": [[key, start, end], ...]}``)."""
        try:
            tenant = self._caller(token, optional=route == "healthz")
        except VitserveError as exc:
            return exc.http_status, {"error": exc.to_dict()}
        if tenant is None:  # /healthz without a token, auth on: liveness alone
            return await self._answer(self._health(None))
        routes = {
            "healthz": lambda: self._health(tenant),
            "probe": lambda: self._probe(payload, tenant),
            "encode": lambda: self._encode_payload(payload, tenant),
            "rows": lambda: self._rows(payload, tenant),
        }
        if route not in routes:
            unknown = MalformedRequestError(f"unknown route {route!r}; use {sorted(routes)}", 404)
            return unknown.http_status, {"error": unknown.to_dict()}
        return await self._answer(routes[route]())

    def _caller(self, token: str | None, optional: bool = False) -> Tenant | None:
        """The tenant ``token`` names (AuthenticationError if none); None for a request
        without a token that may go without one (``optional``: ``/healthz``) with auth on."""
        if optional and token is None and self.gate.enabled:
            return None
        return self.gate.tenant(token)

    async def _health(self, tenant: Tenant | None) -> dict[str, Any]:
        """Liveness, the model (fingerprint and the caller's namespace: what a client keys
        images with) and the request limits a client splits its uploads by; liveness alone for
        a caller without a token when auth is on."""
        if tenant is None:
            return {"status": "ok", "auth": "bearer"}
        limits = self.cfg.limits
        who = {"namespace": tenant.namespace}
        if tenant.name is not None:
            who["tenant"] = tenant.name
        model = await self._describe()
        terms = await self._work_terms()
        return {
            "status": "ok",
            **model,
            **who,
            "row_bytes": terms.row_bytes,
            # where this service's claims live when not every process reaches them (a node's
            # store actor): a client reading a store directly checks it reads the same one
            "claims_at": self._unchecked.connection.claim_scope,
            "limits": {
                "max_images_per_request": limits.max_images_per_request,
                "max_videos_per_request": limits.max_videos_per_request,
                "max_request_bytes": limits.max_request_bytes,
                "max_keys_per_probe": limits.max_keys_per_probe,
                "max_rows_bytes": limits.max_rows_bytes,
            },
        }

    async def _rows(self, payload: Any, tenant: Tenant) -> dict[str, Any]:
        """``{"reads": [[key, start, end], ...]}`` -> ``{"records": [record bytes | None]}``:
        each a record of just those rows (as ``/v1/embeddings/{key}?start=&end=``), read in one
        batched store call."""
        limits = self.cfg.limits
        reads = parse.rows(payload, limits.max_keys_per_probe)
        terms = await self._work_terms()
        # Every read counts (repeats too: each is answered), at the model's row size: an
        # answer over the cap is refused before the store is asked for anything.
        answer = sum(end - start for _, start, end in reads) * terms.row_bytes
        if answer > limits.max_rows_bytes:
            raise LimitExceededError("max_rows_bytes", answer, limits.max_rows_bytes)
        distinct = list(dict.fromkeys(reads))  # each distinct read once from the store
        try:
            with metrics.timed("store_round_trip_seconds", op="get_rows"):
                parts = await asyncio.to_thread(self._store_for(tenant).get_rows_many, distinct)
        except ConfigError as exc:
            raise MalformedRequestError(str(exc)) from None
        encoded = {
            read: None if p is None else bytes(encode_record(_rows_record(p)))
            for read, p in zip(distinct, parts, strict=True)
        }
        records = [encoded[read] for read in reads]
        metrics.inc("bytes_fetched_total", sum(len(r) for r in records if r))
        return {"records": records}

    async def _encode_payload(self, payload: Any, tenant: Tenant) -> dict[str, Any]:
        wait, video_for = EncodeWait.PUBLISHED, VideoFor.MODEL
        if isinstance(payload, dict) and {"wait", "video_for"} & set(payload):
            payload = dict(payload)
            wait = encode_wait(payload.pop("wait", None))
            video_for = encode_video_for(payload.pop("video_for", None))
        images = parse.encode_payload(payload, self.cfg.limits.max_images_per_request)
        terms = await self._work_terms()
        patches = await self.bodies.check(images, terms, wait, video_for)
        return await self._encode_answer(images, tenant, patches, wait, video_for)

    @api.post(
        "/v1/rows",
        summary="Row ranges of several embeddings in one answer",
        openapi_extra=parse.ROWS_OPENAPI,
        responses=error_responses(401, 408, 413, 415, 422, 429, 503),
    )
    async def rows(self, request: Request) -> Response:
        def bundle(body: dict[str, Any]) -> Response:
            return Response(
                pack_records(body["records"]), media_type="application/x-vitserve-records"
            )

        return await self._json_route(request, "rows", self._rows, bundle)

    @api.get(
        "/v1/embeddings/{key}",
        summary="One embedding in the record format",
        responses=error_responses(401, 404, 422, 429, 503),
    )
    async def fetch(
        self, request: Request, key: str, start: int | None = None, end: int | None = None
    ) -> Response:
        try:
            tenant = self.gate.tenant_of_header(request.headers.get("authorization"))
            response = await self._fetch(key, start, end, tenant)
        except VitserveError as exc:
            response = error_response(exc)
        metrics.inc("requests_total", route="fetch", status=str(response.status_code))
        return response

    async def _fetch(
        self, key: str, start: int | None, end: int | None, tenant: Tenant
    ) -> Response:
        parse.key(key)
        whole = start is None and end is None
        start, end = parse.row_range(start, end)
        await self._describe()
        store = self._store_for(tenant)
        if whole:
            with metrics.timed("store_round_trip_seconds", op="get"):
                value = await asyncio.to_thread(store.get_value, key)
            if value is None:
                raise CacheMissError([key])
            body = bytes(value)
            headers = {}
        else:
            try:  # one read: the store checks the range against the record's header
                with metrics.timed("store_round_trip_seconds", op="get_rows"):
                    part = await asyncio.to_thread(store.get_rows, key, start, end)
            except ConfigError as exc:
                raise MalformedRequestError(str(exc)) from None
            if part is None:
                raise CacheMissError([key])
            body = bytes(encode_record(_rows_record(part)))
            headers = {
                "X-Vitserve-Row-Start": str(part.row_start),
                "X-Vitserve-Num-Tokens": str(part.num_tokens),
            }
        metrics.inc("bytes_fetched_total", len(body))
        return Response(body, media_type="application/octet-stream", headers=headers)

    # -- operations ------------------------------------------------------------------------------
    @api.get("/healthz", summary="Liveness, the served model and the request limits")
    async def healthz(self, request: Request) -> Response:
        try:
            tenant = self._caller(bearer_token(request.headers.get("authorization")), optional=True)
        except VitserveError as exc:
            return error_response(exc)
        return JSONResponse(await self._health(tenant))

    @api.get("/metrics", **METRICS_ROUTE)
    async def metrics_page(self, request: Request) -> Response:
        return await metrics_response(self.gate.scrape, request.headers.get("authorization"))

    async def counts(self) -> dict[str, Any]:
        """By handle: this replica's counters and those of the encoder replica the call
        reached (``counters()``), each ``counts`` a ``metrics.Counts``."""
        encoder = await self.encoder.counters.remote()
        replica = serve.get_replica_context().replica_id.unique_id
        return {"ingress": {"replica": replica, "counts": metrics.counts()}, "encoder": encoder}

    @api.get(
        "/v1/stats",
        summary="The counters of this ingress replica and of an encoder replica, exact at once",
        responses=error_responses(401, 503),
    )
    async def stats(self, request: Request) -> Response:
        try:
            # service-wide counters (every tenant's traffic): the operator's, like /metrics
            self.gate.scrape.check(request.headers.get("authorization"))
            both = await self.counts()
        except VitserveError as exc:
            return error_response(exc)
        except Exception as exc:  # Ray's and Serve's errors for an encoder not there
            return error_response(
                ServiceUnavailableError("encoder", f"no counters: {type(exc).__name__}")
            )
        for side in both.values():
            side["counts"] = side["counts"].as_json()
        return JSONResponse(both)


__all__ = ["Ingress", "api"]
