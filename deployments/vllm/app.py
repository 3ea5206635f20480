"""The vLLM front: an OpenAI-compatible chat route that makes vitserve the encoder tier of one or
more vLLM OpenAI servers (``vllm.entrypoints.openai.api_server``), its own Serve application
beside the encoder's.

The rule: a chat's images are handed to vitserve (through the client SDK, hash first: only
images the store lacks are uploaded) and vLLM gets the chat as soon as each new image is claimed
for encoding (``vllm.overlap``: by default when the encoder runs on GPUs, :func:`overlaps`;
off: once its embedding is published), each image
named by its vitserve key, as the content part's ``uuid``; vLLM's encoder-cache connector
(``vitserve.client.vllm``) then loads the rows from vitserve's store instead of running its own
vision tower, holding a request back only while an image its next prefill chunk needs is still
being encoded. vitserve's encode thus runs beside vLLM's own work on the request (rendering,
tokenizing, its processor) and beside the prefill of earlier chunks. Everything else of the
request and of vLLM's answer passes through untouched.

Invariants:

* An image is a content part of type ``image_url`` or ``input_image`` (or vLLM's short form,
  an ``image_url`` part without a type) whose URL is a ``data:`` URL (base64; the scheme in any
  case). All the request's images are encoded in one ``client.encode`` call; each one's part
  gets ``"uuid": <its vitserve key>`` (qualified by the tenant's namespace when it has one,
  ``<namespace>/<key>``: ``vitserve.client.ec_plan.item_identifier``, so that vLLM's connector
  reads each tenant's entry; replacing any the caller set) beside its ``image_url``,
  which keeps the data URL (vLLM still sizes the prompt from the pixels, and they are its
  fallback). A part with another URL (``https://...``) cannot be keyed: with
  ``vllm.remote_media: refuse`` (the default) the request is refused (422, naming the part);
  with ``forward`` it goes to vLLM unchanged, without a uuid, for vLLM to fetch and encode,
  counted in ``x-vitserve-unkeyed``. A request without images goes as it came. Any other
  content part naming a ``uuid`` is refused (422): vLLM would take it as the image's identity,
  so a caller could name another tenant's entry.
* A video is a ``video_url`` content part with a ``data:`` URL of a video container
  (:mod:`vitserve.media`); it is an item like an image (counted with them, encoded in the same
  call, given its ``uuid``) sampled as vLLM's loader samples it (``video_for=vllm``:
  ``FamilySpec.vllm_video`` over the checkpoint's settings, whatever the checkpoint says of
  its own sampling) and keyed under that sampling, for the families whose videos vitserve
  knows vLLM's sampling of (the Qwen families and Gemma 4); other videos go to vLLM
  unkeyed, for it to encode. Bytes of the
  other kind (a video in an image part or the reverse) are refused (422).
* A request with images that sets its own ``media_io_kwargs`` changing the decoded pixels
  (``image.rgba_background_color`` other than white, another ``image_mode``; for a video any
  ``video`` option: frame count, rate, backend) is refused (422): vitserve decoded them as vLLM
  does by default, so its rows would not be the request's.
* With overlap, an image the service accepted (its header within the limits) that fails
  later (it does not decode, the encoder fails) is a miss for vLLM's connector: vLLM decodes
  and encodes it from the data URL itself, and answers as vLLM alone would (its own error for
  an image it cannot decode). What the service refuses before claiming is refused here:
* A request whose images fail is refused before anything is forwarded, with vitserve's errors
  (``{"error": {"type", "message", "param", "code", ...}}``, the shape of vLLM's own errors):
  more image parts than
  ``limits.max_images_per_request`` 413 (counted before any image is decoded), a malformed data
  URL 422, an image the encoder refuses its error (``ImageDecodeError`` 422, ...), whose
  ``index`` is the image's position among the request's image parts; the encoder or the store
  unreachable (after the SDK's retries) 503 with ``Retry-After``. Bad input is never a 5xx.
* Each request goes to exactly one vLLM server, taken round robin over ``vllm.urls`` (per
  replica). One that cannot be reached (connection refused, connect timeout) is passed over for
  the next, each tried once; when none can be, or one took the request and gave no answer in
  ``read_timeout_s`` (not tried elsewhere: it may still be running it), the answer is 503 with
  ``Retry-After: vllm.retry_after_s``. A request a server received is never sent to another.
* vLLM's answer passes through: its status, its ``Content-Type`` and its body bytes, errors
  (4xx/5xx) included; an SSE stream (``"stream": true``) is relayed chunk by chunk as it comes.
  Every forwarded answer carries ``x-vitserve-images`` (image parts), ``x-vitserve-uploaded``
  and ``x-vitserve-cached`` (distinct images the SDK uploaded / found in the store: together,
  the request's distinct images), counted in ``vitserve_vllm_front_images_total{kind}`` too,
  and ``x-vitserve-vllm``, the index in ``vllm.urls`` of the vLLM server that answered (not
  its address: no internal address in an answer).
* The caller's ``Authorization`` never reaches vLLM: with ``vllm.api_key`` set the front sends
  ``Authorization: Bearer <api_key>``, else none.

Routes (under ``vllm.route_prefix``, default ``/vllm``):

* ``POST /v1/chat/completions``: as above.
* ``GET /v1/models``: a vLLM server's model list, passed through (503 if none answers).
* ``GET /healthz``: status, how many vLLM servers, each one's connector state
  (:mod:`~vitserve.deployments.vllm.backends`) and how the encoder is reached (no internal
  address); 503 when no server runs vitserve's connector.

A vLLM server without vitserve's connector would encode every image a second time, silently:
the front reads each server's ``/metrics`` for the connector (at its first chat, then every
``vllm.check_s``), passes a server without it over, and refuses a chat (503, naming why) when
no server has it, before encoding its images.
* ``GET /metrics``: this node's ``vitserve_*`` metrics.

With the config's ``auth`` on, the ``/v1`` routes need ``Authorization: Bearer <token>`` (401
otherwise) and images are encoded with the caller's token, through one client per tenant (as
the prefill application does), so their keys are in the tenant's namespace.

``serve run vitserve.deployments.vllm.app:build_app vllm.urls=http://vllm:8000`` starts it
alone (against a running encoder application named by ``vllm.encoder_app``, or
``vllm.encoder_url``); ``vitserve serve --vllm-url http://vllm:8000`` runs both.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations at run time.
import base64
import binascii
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.concurrency import run_in_threadpool

from vitserve.client.ec_plan import (
    item_identifier,
    pixel_option_problem,
    video_option_problem,
)
from vitserve.deployments.common import metrics
from vitserve.deployments.common import requests as parse
from vitserve.deployments.common.auth import Gate, Tenant, bearer_token
from vitserve.deployments.common.clients import TenantClients
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.common.lifecycle import Draining
from vitserve.deployments.common.requests import DATA_URL
from vitserve.deployments.common.responses import (
    METRICS_ROUTE,
    error_response,
    error_responses,
    install_error_handlers,
    metrics_response,
)
from vitserve.deployments.common.serving import as_deployment, deployment_options
from vitserve.deployments.vllm.backends import Backend, BackendChecks, backend_of_metrics
from vitserve.errors import (
    ConfigError,
    ImageError,
    LimitExceededError,
    MalformedRequestError,
    ServiceUnavailableError,
    VitserveError,
)
from vitserve.keys import video_settings
from vitserve.media import Media, VideoFor, media_of

log = logging.getLogger("ray.serve")

#: the answer headers that count a forwarded request's images
COUNT_HEADERS = (
    "x-vitserve-images",
    "x-vitserve-uploaded",
    "x-vitserve-cached",
    "x-vitserve-unkeyed",
)
#: the answer header naming the vLLM server that answered
REPLICA_HEADER = "x-vitserve-vllm"
#: request headers passed on to vLLM (besides the content type and the front's own)
PASSED_HEADERS = ("accept", "x-request-id")
#: failures of a request no vLLM server received: the next one is tried
NOT_RECEIVED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

api = FastAPI(
    title="vitserve vLLM front",
    summary="OpenAI chat completions for vLLM servers, images encoded by vitserve.",
    version="0.1.0",
)
install_error_handlers(api)  # every error answer in the encoder API's shape (responses.py)
api.add_middleware(Draining)  # graceful stop: drain, then 503 (lifecycle.py)


# -- the request's images ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Image:
    """A data-URL image of a request: its content part (given its ``uuid``), its position
    among the request's image parts, and its bytes."""

    part: dict[str, Any]
    index: int
    data: bytes


#: content part types whose ``image_url`` the front keys (vLLM reads both)
IMAGE_PART_TYPES = ("image_url", "input_image")
#: content part types whose ``video_url`` the front keys
VIDEO_PART_TYPES = ("video_url",)


def _is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and (
        part.get("type") in VIDEO_PART_TYPES or ("type" not in part and "video_url" in part)
    )


def _is_image_part(part: Any) -> bool:
    """An image or video part (the items the front keys)."""
    return _is_video_part(part) or (
        isinstance(part, dict)
        and (part.get("type") in IMAGE_PART_TYPES or ("type" not in part and "image_url" in part))
    )


def _is_data_url(url: Any) -> bool:
    return isinstance(url, str) and url[:5].lower() == "data:"  # a scheme is case-insensitive


def _no_caller_uuids(messages: Any) -> None:
    """MalformedRequestError for a content part that names a ``uuid`` the front does not set
    itself: vLLM takes a part's ``uuid`` as the image's identity (its caches, and the
    connector's key into vitserve's store), so a caller's would name another's entry."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and "uuid" in part:
                if _is_image_part(part) and _is_data_url(_url(part)):
                    continue  # the front replaces it with the image's own key
                raise MalformedRequestError(
                    "a content part names a 'uuid': the vitserve front sets an image's uuid "
                    "(its key) from the image's bytes; remove it (other parts go to vLLM "
                    "without one)"
                )


def _url(part: dict[str, Any]) -> Any:
    # {"url": ...}, or vLLM's short form: the URL itself
    value = part.get("video_url" if _is_video_part(part) else "image_url")
    return value.get("url") if isinstance(value, dict) else value


def data_url_bytes(url: str, index: int) -> bytes:
    """The bytes of a base64 ``data:`` URL (MalformedRequestError naming image ``index``)."""
    m = DATA_URL.match(url)
    if m is None or not m["b64"]:
        raise MalformedRequestError(f"image {index}: a data: URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(m["data"], validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRequestError(f"image {index}: the data: URL is not valid base64") from None


def request_images(body: Any, max_images: int) -> tuple[int, list[Image]]:
    """(the count of image parts, the data-URL images among them in order) of a chat request;
    LimitExceededError (413) past ``max_images`` parts, before any image is decoded."""
    if not isinstance(body, dict):
        raise MalformedRequestError("a chat completions request is a JSON object")
    messages = body.get("messages")
    parts = [
        part
        for message in (messages if isinstance(messages, list) else ())
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if _is_image_part(part)
    ]
    if len(parts) > max_images:
        raise LimitExceededError("max_images_per_request", len(parts), max_images)
    _no_caller_uuids(messages)
    images = []
    for index, part in enumerate(parts):
        url = _url(part)
        if _is_data_url(url):
            data = data_url_bytes(url, index)
            if (media_of(data) is Media.VIDEO) != _is_video_part(part):
                kind = "a video part holds an image" if _is_video_part(part) else "a video"
                raise MalformedRequestError(
                    f"image {index}: {kind}"
                    + ("" if _is_video_part(part) else "; send it in a video_url part")
                )
            images.append(Image(part, index, data))
    return len(parts), images


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to forward: its body and its image counts."""

    content: bytes
    images: int = 0  # image parts
    uploaded: int = 0  # distinct images whose bytes went to the encoder
    cached: int = 0  # distinct images the store held already
    unkeyed: int = 0  # image parts forwarded without a key (vLLM encodes them itself)

    def headers(self) -> dict[str, str]:
        counts = (self.images, self.uploaded, self.cached, self.unkeyed)
        return dict(zip(COUNT_HEADERS, map(str, counts), strict=True))


def remote_media_refusal(indices: list[int]) -> MalformedRequestError:
    """The error for image parts whose URL is not a ``data:`` URL, under ``vllm.remote_media:
    refuse``: vitserve keys only bytes it was given; vLLM would fetch and encode them itself."""
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return MalformedRequestError(
        f"image part{'s' if len(indices) > 1 else ''} {shown}: a URL that is not a data: URL. "
        "The vitserve front keys the images it is sent; send each one as a data: URL "
        "(data:image/png;base64,...), or set vllm.remote_media=forward to let vLLM fetch and "
        "encode it itself (unkeyed, counted in x-vitserve-unkeyed)"
    )


def upstream_headers(incoming: Mapping[str, str], api_key: str | None) -> dict[str, str]:
    """The headers of a request to vLLM: JSON, uncompressed (relayed byte for byte), the
    caller's ``Accept`` and ``X-Request-Id``, and ``Authorization`` only with ``api_key``."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    headers.update((name, incoming[name]) for name in PASSED_HEADERS if name in incoming)
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


# -- the vLLM servers -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Server:
    """One of ``vllm.urls``: answers name it by its index (``name``, ``x-vitserve-vllm``), the
    log by its URL too: no internal address in an answer."""

    index: int
    url: str

    @property
    def name(self) -> str:
        return f"vLLM server {self.index}"

    @property
    def shown(self) -> str:
        """The URL as a log shows it: a password in it masked."""
        from vitserve.cache.urls import redact_url

        return redact_url(self.url)


class Upstreams:
    """The vLLM servers: one pooled ``httpx.AsyncClient`` each, taken round robin."""

    def __init__(
        self, urls: list[str], connect_s: float, read_s: float, max_connections: int
    ) -> None:
        if not urls:
            raise ConfigError("the vLLM front needs at least one vLLM server URL (vllm.urls)")
        self.urls = list(urls)
        timeout = httpx.Timeout(read_s, connect=connect_s, pool=connect_s)
        limits = httpx.Limits(max_connections=max_connections)
        self.clients = [
            httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) for url in urls
        ]
        self._turn = itertools.count()

    async def send(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        content: bytes | None = None,
        takes: Callable[[int], bool] | None = None,
    ) -> tuple[Server, httpx.Response]:
        """(the server, its answer, its body still to read) from the next server in turn that
        can be reached (and ``takes`` the request, by its index: ``backends``);
        ServiceUnavailableError (503) when none can be, or when the one that took the request
        gave no answer in time."""
        first = next(self._turn) % len(self.urls)
        failed = []
        for i in range(first, first + len(self.urls)):
            server = Server(i % len(self.urls), self.urls[i % len(self.urls)])
            if takes is not None and not takes(server.index):
                failed.append(f"{server.name}: no vitserve connector")
                continue
            client = self.clients[server.index]
            request = client.build_request(method, path, headers=headers, content=content)
            try:
                return server, await client.send(request, stream=True)
            except NOT_RECEIVED as exc:
                failed.append(f"{server.name}: {type(exc).__name__}")
                log.warning("%s (%s) cannot be reached: %r", server.name, server.shown, exc)
            except httpx.TransportError as exc:  # it took the request: not sent elsewhere
                log.warning("%s (%s) gave no answer: %r", server.name, server.shown, exc)
                raise ServiceUnavailableError(
                    server.name, f"no answer: {type(exc).__name__}"
                ) from None
        raise ServiceUnavailableError("vLLM", f"no server could be reached ({'; '.join(failed)})")

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


async def passed_through(
    server: Server, response: httpx.Response, headers: dict[str, str]
) -> Response:
    """vLLM's answer as the front's: its status, content type and body bytes (an SSE stream
    relayed chunk by chunk), with ``headers`` added."""
    ctype = response.headers.get("content-type")
    headers = {**headers, **({"content-type": ctype} if ctype else {})}  # kept as it is
    if ctype and ctype.startswith("text/event-stream"):
        return StreamingResponse(
            _relay(server, response), status_code=response.status_code, headers=headers
        )
    try:
        body = await response.aread()
    except httpx.TransportError as exc:
        log.warning("%s (%s): answer cut short: %r", server.name, server.shown, exc)
        raise ServiceUnavailableError(
            server.name, f"answer cut short: {type(exc).__name__}"
        ) from None
    finally:
        await response.aclose()
    return Response(body, status_code=response.status_code, headers=headers)


async def _relay(server: Server, response: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's bytes as they come; a stream cut short ends with an error event (no
    ``[DONE]``), as vLLM ends a stream that fails. The caller gone: vLLM's connection closes
    (vLLM aborts the request)."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.warning("%s (%s): stream cut short: %r", server.name, server.shown, exc)
        error = ServiceUnavailableError(server.name, f"stream cut short: {type(exc).__name__}")
        yield f"data: {json.dumps({'error': error.to_dict()})}\n\n".encode()
    finally:
        await response.aclose()


# -- the application --------------------------------------------------------------------------
def overlaps(cfg: VitserveConfig) -> bool:
    """Whether the front hands vLLM a chat at its images' claims (``vllm.overlap``; unset: when
    the encoder runs on GPUs of its own, not on CPU cores it shares with vLLM). Defined above
    the deployment class: Serve serializes the class with the names defined when it is made."""
    if cfg.vllm.overlap is not None:
        return cfg.vllm.overlap
    gpus = cfg.encoder.num_gpus or 0
    return (cfg.device or "").startswith("cuda") or gpus > 0


@serve.deployment
@serve.ingress(api)
class VllmFront:
    def __init__(self, config: dict[str, Any]) -> None:
        self.cfg = VitserveConfig.model_validate(config)
        v = self.cfg.vllm
        self.upstreams = Upstreams(
            v.urls, v.connect_timeout_s, v.read_timeout_s, v.max_ongoing_requests
        )
        self.api_key = v.api_key.get_secret_value() if v.api_key is not None else None
        self.clients = TenantClients(self.cfg, self.cfg.vllm)  # made at a first request
        self.gate = Gate(self.cfg)  # who calls (None: auth off), within the tenant's rate
        self.overlap = overlaps(self.cfg)
        self.checks = BackendChecks(len(v.urls), self._read_backend, v.check_s)

    async def _read_backend(self, i: int) -> Backend:
        """vLLM server ``i``'s state from its ``/metrics`` (``backends``)."""
        client, timeout = self.upstreams.clients[i], 2 * self.cfg.vllm.connect_timeout_s
        headers = upstream_headers({}, self.api_key)
        try:
            answer = await client.get("/metrics", headers=headers, timeout=timeout)
        except httpx.HTTPError:
            return Backend.UNREACHABLE
        state = backend_of_metrics(answer.status_code, answer.text)
        if state is Backend.NO_CONNECTOR:
            server = Server(i, self.upstreams.urls[i])
            log.error(
                "%s (%s) runs without vitserve's connector: it takes no chat from this front",
                server.name,
                server.shown,
            )
        return state

    async def _checked(self) -> None:
        """The servers' connector states read where due (beside the chat); a chat no server
        may take (none runs the connector, by reads it waits for where due) is refused here."""
        await self.checks.refresh(wait=False)
        if self.checks.refusal() is not None:  # never refused by a state a due read would change
            await self.checks.refresh(wait=True)
        refusal = self.checks.refusal()
        if refusal is not None:
            raise refusal

    def _prepare(self, raw: bytearray, tenant: Tenant | None, token: str | None) -> Prepared:
        """The body to forward: the request's images encoded, each named by its key (blocking:
        run in a worker thread)."""
        limits = self.cfg.limits
        body = parse.json_body(raw, limits.max_chat_json_values)  # values counted before parsing
        count, images = request_images(body, limits.max_images_per_request)
        keyed = {image.index for image in images}
        remote = [i for i in range(count) if i not in keyed]  # not data: URLs
        if remote and self.cfg.vllm.remote_media == "refuse":
            raise remote_media_refusal(remote)
        # a request's own media options that would make vLLM decode other pixels than
        # vitserve did: refused, its images' rows could not be vouched for
        problem = pixel_option_problem(body.get("media_io_kwargs")) if images else None
        videos = sum(media_of(image.data) is Media.VIDEO for image in images)
        if videos and problem is None:
            problem = video_option_problem(body)
        if videos > limits.max_videos_per_request:
            raise LimitExceededError(
                "max_videos_per_request", videos, limits.max_videos_per_request
            )
        if problem is not None:
            raise MalformedRequestError(f"{problem}; send the images without it")
        if not images:
            return Prepared(bytes(raw), count, unkeyed=len(remote))
        client = self.clients.get(tenant, token)
        model = client.describe()
        if videos and video_settings(model, VideoFor.VLLM) is None:
            # vitserve does not know how vLLM samples this model's videos: they go unkeyed
            images = [i for i in images if media_of(i.data) is Media.IMAGE]
            if not images:
                return Prepared(bytes(raw), count, unkeyed=count)
        datas = [image.data for image in images]
        way = VideoFor.VLLM  # videos sampled as vLLM's loader samples them (ignored by images)
        try:
            if self.overlap:  # answered once claimed: the encode runs beside vLLM
                sent = [(s.key, s.uploaded) for s in client.submit(datas, way)]
            else:
                sent = [(h.key, h.uploaded) for h in client.encode(datas, way)]
        except ImageError as exc:  # its index in the encode call -> among the image parts
            if isinstance(exc.index, int) and 0 <= exc.index < len(images):
                exc.index = images[exc.index].index
                exc.args = (f"image {exc.index}: {getattr(exc, 'reason', exc)}",)
            raise
        # the entry's name in vLLM: its key, qualified by the tenant's namespace (ec_plan)
        namespace = str(client.describe().get("namespace") or "")
        for image, (key, _) in zip(images, sent, strict=True):
            image.part["uuid"] = item_identifier(namespace, key)
        distinct = dict(sent)
        uploaded = sum(distinct.values())
        content = json.dumps(body, separators=(",", ":")).encode()
        unkeyed = count - len(images)  # remote URLs, and videos sent unkeyed
        return Prepared(content, count, uploaded, len(distinct) - uploaded, unkeyed)

    def _authenticate(self, request: Request) -> tuple[Tenant | None, str | None]:
        token = bearer_token(request.headers.get("authorization"))
        return self.gate.caller(token), token

    def _error(self, exc: VitserveError, route: str) -> Response:
        metrics.inc("requests_total", route=route, status=str(exc.http_status))
        retry = self.cfg.vllm.retry_after_s
        return error_response(exc, {"Retry-After": str(retry)} if exc.http_status == 503 else None)

    @api.post(
        "/v1/chat/completions",
        summary="OpenAI chat completions, forwarded to vLLM with the images encoded",
        openapi_extra=parse.CHAT_OPENAPI,
        responses=error_responses(401, 408, 413, 415, 422, 429, 503),
    )
    async def completions(self, request: Request) -> Response:
        try:
            tenant, token = self._authenticate(request)  # before the body
            parse.json_type(request.headers.get("content-type"))
            await self._checked()
            limits = self.cfg.limits
            raw = await parse.read_body(request, limits.max_request_bytes, limits.body_timeout_s)
            prepared = await run_in_threadpool(self._prepare, raw, tenant, token)
            counts = {
                "sent": prepared.images,
                "uploaded": prepared.uploaded,
                "cached": prepared.cached,
                "unkeyed": prepared.unkeyed,
            }
            for kind, count in counts.items():
                metrics.inc("vllm_front_images_total", count, kind=kind)
            await self._checked()  # a read that ended while the images encoded
            server, response = await self.upstreams.send(
                "POST",
                "/v1/chat/completions",
                upstream_headers(request.headers, self.api_key),
                prepared.content,
                takes=self.checks.takes_chats,
            )
            answer = await passed_through(
                server, response, {**prepared.headers(), REPLICA_HEADER: str(server.index)}
            )
        except VitserveError as exc:
            return self._error(exc, "vllm_chat")
        metrics.inc("requests_total", route="vllm_chat", status=str(answer.status_code))
        return answer

    @api.get(
        "/v1/models",
        summary="A vLLM server's model list, passed through",
        responses=error_responses(401, 429, 503),
    )
    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
            server, response = await self.upstreams.send(
                "GET", "/v1/models", upstream_headers(request.headers, self.api_key)
            )
            answer = await passed_through(server, response, {})
        except VitserveError as exc:
            return self._error(exc, "vllm_models")
        metrics.inc("requests_total", route="vllm_models", status=str(answer.status_code))
        return answer

    @api.get(
        "/healthz",
        summary="Liveness, the vLLM servers (with vitserve's connector or not) and where the "
        "encoder is reached; 503 when no server runs the connector",
    )
    async def healthz(self) -> Response:
        v = self.cfg.vllm
        await self.checks.refresh()
        refusal = self.checks.refusal()
        body: dict[str, Any] = {  # how many and how, not where: no internal address
            "status": "ok" if refusal is None else "no_connector",
            "servers": len(v.urls),
            # each server's state by its index (backends.Backend)
            "backends": self.checks.states(),
            "encoder": "by URL" if v.encoder_url else f"app {v.encoder_app}",
        }
        if refusal is not None:
            body["error"] = refusal.to_dict()
        return JSONResponse(body, status_code=200 if refusal is None else 503)

    @api.get("/metrics", **METRICS_ROUTE)
    async def metrics_page(self, request: Request) -> Response:
        return await metrics_response(self.gate.scrape, request.headers.get("authorization"))


def build_vllm_application(cfg: VitserveConfig) -> Any:
    """The bound vLLM front for ``cfg`` (no model is loaded: vLLM has it, the encoder its
    vision tower); ConfigError without ``vllm.urls``."""
    if not cfg.vllm.urls:
        raise ConfigError(
            "the vLLM front needs at least one vLLM server URL (vllm.urls, or "
            "vitserve serve --vllm-url)"
        )
    return as_deployment(VllmFront).options(**deployment_options(cfg.vllm)).bind(cfg.model_dump())


def build_app(args: Mapping[str, Any]) -> Any:
    """The vLLM front from ``serve run``/YAML-style args (as ``app.build_app``)."""
    return build_vllm_application(VitserveConfig.load(args))


__all__ = [
    "VllmFront",
    "api",
    "build_app",
    "build_vllm_application",
    "data_url_bytes",
    "overlaps",
    "request_images",
    "upstream_headers",
]
