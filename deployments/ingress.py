"""The HTTP ingress: FastAPI under ``@serve.ingress``; OpenAPI at ``/docs``; all on one port.

Routes:

* ``POST /v1/encode``: images as repeated multipart fields ``images``, or JSON
  ``{"images": [{"data": "<base64>"} | {"key": "<hex>"}]}`` (a key-only item names an image the
  caller believes cached). Answer: ``{"items": [...]}`` in input order, each
  ``{key, num_tokens, grid, dtype, shape, extras, cached}`` or ``{error}``.
* ``POST /v1/probe``: ``{"keys": [...]}`` -> ``{"exists": [bool, ...]}``; with ``"headers":
  true`` also ``"items"``, each held key's description (as an encode item) or null.
* ``GET /v1/embeddings/{key}[?start=&end=]``: the record (``application/octet-stream``, the
  store's record format); with a row range, a record of just those rows, whose first row is
  row ``X-Vitserve-Row-Start`` of the image's ``X-Vitserve-Num-Tokens``.
* ``POST /v1/rows``: ``{"reads": [[key, start, end], ...]}`` -> the row records of every
  read in one body (``application/x-vitserve-records``, see ``cache.codec.pack_records``; a
  missing key has length 0), read in one batched store call.
* ``GET /healthz``, ``GET /metrics`` (this node's ``vitserve_*`` metrics, Prometheus text).

Callers inside the Ray cluster reach the same answers through the deployment's handle:
``Ingress.call(route, payload)`` (the client SDK's handle transport).

Request-level limits are checked before any work, from the request's size and each image's
header: too many images, too many bytes, an image over ``max_image_bytes`` or
``max_image_pixels`` -> 413 (422 for malformed input) with a JSON error naming the limit; the
request then costs nothing else. Images that pass the limits but do not decode or preprocess
fail alone: their item carries the error, the others are encoded. A full encoder queue -> 429
with ``Retry-After``. A store that is down -> 503 for fetches and probes, while encodes still
answer (from a tiered store's local tier, or by encoding).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations
# (``Request``) at run time inside Serve's class-based ingress.
import asyncio
import base64
import binascii
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from vitserve.deployments import metrics
from vitserve.deployments.config import VitserveConfig
from vitserve.deployments.encode_flow import EncodeFlow
from vitserve.deployments.responses import error_response, metrics_response, retry_headers
from vitserve.errors import (
    CacheMissError,
    ConfigError,
    ImageError,
    LimitExceededError,
    MalformedRequestError,
    VitserveError,
)

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log
KEY_RE = re.compile(r"^[0-9a-f]{64}$")

api = FastAPI(
    title="vitserve",
    summary="Disaggregated vision encoder: encode images once, fetch embeddings by key.",
    version="0.1.0",
)


def _rows_record(part: Any) -> Any:
    """A row-range read as a record of just those rows (what the row routes answer)."""
    from vitserve.cache.codec import EmbeddingRecord

    return EmbeddingRecord(key=part.key, fingerprint=part.fingerprint, dtype=part.dtype,
                           num_tokens=len(part.embedding), grid=part.grid,
                           tensors=part.tensors)  # fmt: skip


@serve.deployment
@serve.ingress(api)
class Ingress:
    def __init__(self, encoder: Any, preprocess: Any, config: dict[str, Any]) -> None:
        """``preprocess``: the preprocess deployment's handle, or None unless the config's
        ``preprocess_at`` is ``deployment``."""
        from vitserve.cache import open_store

        self.cfg = VitserveConfig.model_validate(config)
        self.encoder = encoder
        self.store = open_store(self.cfg.store, namespace=self.cfg.namespace)
        preprocessor = None
        if self.cfg.preprocess_at == "ingress":
            from vitserve.deployments.encoder import make_preprocessor
            from vitserve.encoder.device import tune_cpu_allocator

            tune_cpu_allocator()  # see WORKER_ENV in app.py
            preprocessor = make_preprocessor(self.cfg)
        self.flow = EncodeFlow(self.cfg, self.store, encoder, preprocess, preprocessor)
        self._model: dict[str, Any] | None = None

    async def _describe(self) -> dict[str, Any]:
        if self._model is None:
            self._model = await self.encoder.describe.remote()
            self.store.fingerprint = self._model["fingerprint"]
        return self._model

    # -- encode ------------------------------------------------------------------------------
    @api.post("/v1/encode", summary="Encode images (multipart or JSON); items in input order")
    async def encode(self, request: Request) -> Response:
        try:
            items = await self._read_images(request)
            response = JSONResponse(await self._encode_answer(items))
        except VitserveError as exc:
            response = error_response(exc)
        metrics.inc("requests_total", route="encode", status=str(response.status_code))
        return response

    async def _read_images(self, request: Request) -> list[bytes | str]:
        """The request's items: image bytes or keys; request-level limits checked."""
        limits = self.cfg.limits
        length = request.headers.get("content-length")
        if length is not None and int(length) > limits.max_request_bytes:
            raise LimitExceededError("max_request_bytes", int(length), limits.max_request_bytes)
        ctype = request.headers.get("content-type", "")
        items: list[bytes | str] = []
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_files=limits.max_images_per_request + 1,
                                      max_part_size=limits.max_image_bytes + 1)  # fmt: skip
            for upload in form.getlist("images"):
                if isinstance(upload, str):
                    raise MalformedRequestError("multipart field 'images' must be a file")
                items.append(await upload.read())
            unknown = set(form.keys()) - {"images"}
            if unknown:
                raise MalformedRequestError(f"unknown multipart fields: {sorted(unknown)}")
        elif ctype.startswith("application/json"):
            items = self._json_items(await request.body())
        else:
            raise MalformedRequestError(
                f"unsupported content type {ctype!r}; use multipart/form-data or JSON", 415
            )
        self._check_request(items)
        return items

    def _check_request(self, items: list[bytes | str]) -> None:
        """The request-level limits: image count, total bytes, each image's bytes and pixels."""
        limits = self.cfg.limits
        if not items:
            raise MalformedRequestError("no images in the request")
        if len(items) > limits.max_images_per_request:
            raise LimitExceededError("max_images_per_request", len(items),
                               limits.max_images_per_request)  # fmt: skip
        total = sum(len(i) for i in items if isinstance(i, bytes))
        if total > limits.max_request_bytes:
            raise LimitExceededError("max_request_bytes", total, limits.max_request_bytes)
        self._check_images(items)

    def _json_items(self, body: bytes) -> list[bytes | str]:
        import json

        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise MalformedRequestError(f"invalid JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != {"images"} or not isinstance(doc["images"],
                                                                                list):  # fmt: skip
            raise MalformedRequestError('expected {"images": [{"data": ...} | {"key": ...}]}')
        items: list[bytes | str] = []
        for i, item in enumerate(doc["images"]):
            if isinstance(item, dict) and set(item) == {"data"} and isinstance(item["data"], str):
                try:
                    items.append(base64.b64decode(item["data"], validate=True))
                except (binascii.Error, ValueError):
                    raise MalformedRequestError(f"images[{i}].data is not base64") from None
            elif isinstance(item, dict) and set(item) == {"key"} and isinstance(item["key"], str):
                if not KEY_RE.match(item["key"]):
                    raise MalformedRequestError(f"images[{i}].key is not a 64-hex key")
                items.append(item["key"])
            else:
                raise MalformedRequestError(
                    f'images[{i}] must be {{"data": ...}} or {{"key": ...}}'
                )
        return items

    def _check_images(self, items: list[bytes | str]) -> None:
        """Byte and pixel limits of each image, from its header only (no decode)."""
        from vitserve.encoder.images import ImageLimits, image_size

        limits = ImageLimits(max_image_bytes=self.cfg.limits.max_image_bytes,
                             max_image_pixels=self.cfg.limits.max_image_pixels)  # fmt: skip
        for i, item in enumerate(items):
            if isinstance(item, bytes):
                try:
                    image_size(item, index=i, limits=limits)
                except ImageError as exc:
                    if exc.http_status == 413:  # over a limit: refuse the request up front
                        raise
                    # undecodable: that item fails alone (the preprocessor says why)

    async def _encode_answer(self, items: list[bytes | str]) -> dict[str, Any]:
        from vitserve.keys import content_key

        model = await self._describe()
        keys = [i if isinstance(i, str) else content_key(i, model["fingerprint"],
                                                           self.cfg.namespace)
                for i in items]  # fmt: skip
        return {"items": await self.flow.encode(items, keys)}

    # -- probe and fetch -------------------------------------------------------------------------
    @api.post("/v1/probe", summary="Which keys the store holds (and, asked, their headers)")
    async def probe(self, request: Request) -> Response:
        return await self._json_route(request, "probe", self._probe)

    async def _json_route(self, request: Request, route: str, work: Any,
                          answer: Any = None) -> Response:  # fmt: skip
        """A route whose request is JSON: ``work(doc)``'s answer (as JSON, or as
        ``answer(body)`` makes it), or its error (``Retry-After`` where a retry can help);
        counted in ``requests_total``."""
        import json

        try:
            doc = json.loads(await request.body())
        except ValueError as exc:
            response = error_response(MalformedRequestError(f"invalid JSON: {exc}"))
        else:
            status, body = await self._answer(work(doc))
            if status == 200 and answer is not None:
                response = answer(body)
            else:
                response = JSONResponse(body, status_code=status, headers=retry_headers(status))
        metrics.inc("requests_total", route=route, status=str(response.status_code))
        return response

    async def _probe(self, doc: Any) -> dict[str, Any]:
        """``{"keys": [...], "headers": false}`` -> ``{"exists": [...]}``; with ``"headers":
        true`` also ``"items"``: each held key's description (as an encode item, ``cached:
        true``) or null, read in the same store round trip."""
        if not isinstance(doc, dict) or not set(doc) <= {"keys", "headers"} or "keys" not in doc:
            raise MalformedRequestError('expected {"keys": [...], "headers": false}')
        keys, with_headers = doc["keys"], doc.get("headers", False)
        if not isinstance(keys, list) or not all(isinstance(k, str) and KEY_RE.match(k)
                                                 for k in keys):  # fmt: skip
            raise MalformedRequestError("keys must be a list of 64-hex keys")
        if not isinstance(with_headers, bool):
            raise MalformedRequestError("headers must be true or false")
        if len(keys) > self.cfg.limits.max_keys_per_probe:
            raise LimitExceededError("max_keys_per_probe", len(keys),
                                     self.cfg.limits.max_keys_per_probe)  # fmt: skip
        if not with_headers:
            with metrics.timed("store_round_trip_seconds", op="exists"):
                return {"exists": await asyncio.to_thread(self.store.exists_many, keys)}
        await self._describe()  # the store checks each header's fingerprint
        from vitserve.deployments.encoder import describe_header

        with metrics.timed("store_round_trip_seconds", op="headers"):
            headers = await asyncio.to_thread(self.store.headers_many, keys)
        items = [None if h is None else {**describe_header(h), "cached": True} for h in headers]
        return {"exists": [h is not None for h in headers], "items": items}

    async def _answer(self, work: Any) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)`` of a route's work: its answer, or its error's."""
        try:
            return 200, await work
        except VitserveError as exc:
            return exc.http_status, {"error": exc.to_dict()}

    # -- callers inside the Ray cluster ------------------------------------------------------------
    async def call(self, route: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The API for a caller holding this deployment's handle (the client SDK inside the
        cluster): the same answers as the HTTP routes, as ``(status, JSON body)``, without the
        HTTP proxy. ``route``: ``healthz`` (no payload), ``probe`` (the JSON of
        ``/v1/probe``), ``encode`` (``{"images": [bytes | 64-hex key, ...]}``, the limits of
        ``/v1/encode`` checked the same way), ``rows`` (``{"reads": [[key, start, end], ...]}``)."""
        routes = {"healthz": lambda: self._health(), "probe": lambda: self._probe(payload),
                  "encode": lambda: self._encode_payload(payload),
                  "rows": lambda: self._rows(payload)}  # fmt: skip
        if route not in routes:
            unknown = MalformedRequestError(f"unknown route {route!r}; use {sorted(routes)}", 404)
            return unknown.http_status, {"error": unknown.to_dict()}
        return await self._answer(routes[route]())

    async def _health(self) -> dict[str, Any]:
        """Liveness, the model (fingerprint and namespace: what a client keys images with)
        and the request limits a client splits its uploads by."""
        limits = self.cfg.limits
        return {"status": "ok", **await self._describe(),
                "limits": {"max_images_per_request": limits.max_images_per_request,
                           "max_request_bytes": limits.max_request_bytes,
                           "max_keys_per_probe": limits.max_keys_per_probe}}  # fmt: skip

    async def _rows(self, payload: Any) -> dict[str, Any]:
        """``{"reads": [[key, start, end], ...]}`` -> ``{"records": [record bytes | None]}``:
        each a record of just those rows (as ``/v1/embeddings/{key}?start=&end=``), read in one
        batched store call."""
        from vitserve.cache.codec import encode_record

        reads = payload.get("reads") if isinstance(payload, dict) else None
        if not isinstance(reads, list) or not all(
            isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and KEY_RE.match(r[0])
            and all(isinstance(x, int) for x in r[1:]) for r in reads
        ):  # fmt: skip
            raise MalformedRequestError('expected {"reads": [[key, start, end], ...]}')
        if len(reads) > self.cfg.limits.max_keys_per_probe:
            raise LimitExceededError("max_keys_per_probe", len(reads),
                                     self.cfg.limits.max_keys_per_probe)  # fmt: skip
        await self._describe()
        try:
            with metrics.timed("store_round_trip_seconds", op="get_rows"):
                parts = await asyncio.to_thread(self.store.get_rows_many,
                                                [tuple(r) for r in reads])  # fmt: skip
        except ConfigError as exc:
            raise MalformedRequestError(str(exc)) from None
        records = [None if p is None else bytes(encode_record(_rows_record(p))) for p in parts]
        metrics.inc("bytes_fetched_total", sum(len(r) for r in records if r))
        return {"records": records}

    async def _encode_payload(self, payload: Any) -> dict[str, Any]:
        images = payload.get("images") if isinstance(payload, dict) else None
        if (
            not isinstance(images, list)
            or set(payload) != {"images"}
            or not all(
                isinstance(i, bytes) or (isinstance(i, str) and KEY_RE.match(i)) for i in images
            )
        ):
            raise MalformedRequestError('expected {"images": [bytes | 64-hex key, ...]}')
        self._check_request(images)
        return await self._encode_answer(images)

    @api.post("/v1/rows", summary="Row ranges of several embeddings in one answer")
    async def rows(self, request: Request) -> Response:
        from vitserve.cache.codec import pack_records

        def bundle(body: dict[str, Any]) -> Response:
            return Response(pack_records(body["records"]),
                            media_type="application/x-vitserve-records")  # fmt: skip

        return await self._json_route(request, "rows", self._rows, bundle)

    @api.get("/v1/embeddings/{key}", summary="One embedding in the record format")
    async def fetch(self, key: str, start: int | None = None, end: int | None = None) -> Response:
        try:
            response = await self._fetch(key, start, end)
        except VitserveError as exc:
            response = error_response(exc)
        metrics.inc("requests_total", route="fetch", status=str(response.status_code))
        return response

    async def _fetch(self, key: str, start: int | None, end: int | None) -> Response:
        from vitserve.cache.codec import encode_record

        if not KEY_RE.match(key):
            raise MalformedRequestError("key must be 64 hex characters")
        await self._describe()
        if start is None and end is None:
            with metrics.timed("store_round_trip_seconds", op="get"):
                value = await asyncio.to_thread(self.store.get_value, key)
            if value is None:
                raise CacheMissError([key])
            body = bytes(value)
            headers = {}
        else:
            try:  # one read: the store checks the range against the record's header
                with metrics.timed("store_round_trip_seconds", op="get_rows"):
                    part = await asyncio.to_thread(self.store.get_rows, key, start or 0, end)
            except ConfigError as exc:
                raise MalformedRequestError(str(exc)) from None
            if part is None:
                raise CacheMissError([key])
            body = bytes(encode_record(_rows_record(part)))
            headers = {"X-Vitserve-Row-Start": str(part.row_start),
                       "X-Vitserve-Num-Tokens": str(part.num_tokens)}  # fmt: skip
        metrics.inc("bytes_fetched_total", len(body))
        return Response(body, media_type="application/octet-stream", headers=headers)

    # -- operations ------------------------------------------------------------------------------
    @api.get("/healthz", summary="Liveness, the served model and the request limits")
    async def healthz(self) -> Response:
        return JSONResponse(await self._health())

    @api.get("/metrics", summary="This node's vitserve metrics (Prometheus text format)")
    async def metrics_page(self) -> Response:
        return await metrics_response()


__all__ = ["Ingress", "api"]
