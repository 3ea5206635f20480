"""The ingress's request bodies, read off the event loop; an encode's items checked before any
store or encoder call.

The ingress's ``/v1/encode`` (multipart or JSON) and its handle route ``encode`` come here for
their items (image or video bytes, or keys the caller believes held) and each item's patches
(the encoder router's hint). Every check reads only sizes and headers, never decodes pixels:
the item count (before any base64 is decoded), the bytes, each image's bytes and pixels, and
the request's work (patches, and bytes: prepared arrays plus their decodings) against what one
encoder replica admits (``Terms``, the encoder's own rule: ``admission.image_work``).

Invariants:

* A request that breaks a limit costs nothing else: it is refused here (413 naming the limit;
  422 for a malformed body or parameter; 415 for another content type).
* Bodies are parsed, and headers and keys read, in this reader's two threads, never on the
  event loop: ``/healthz`` and the other requests are answered meanwhile, and two bound what
  runs at once.
* With ``wait=claimed`` (an answer before the images' errors could be told) an image whose
  header does not read refuses the whole request here.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from vitserve.client.handles import EncodeWait
from vitserve.deployments.common import requests as parse
from vitserve.deployments.common.config import LimitsConfig
from vitserve.deployments.encoder.admission import check_fits, image_work, request_cost
from vitserve.encoder.work import Terms
from vitserve.errors import LimitExceededError, MalformedRequestError
from vitserve.media import VideoFor

E = TypeVar("E", bound=enum.Enum)


def enum_param(kind: type[E], name: str, value: str | None, default: E) -> E:
    """A request parameter (query, or a handle payload's field) read as ``kind``: absent is
    ``default``; anything but one of its values is a 422 naming them."""
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(member.value) for member in kind)
        raise MalformedRequestError(
            f"{name}={str(value)[:40]!r}: expected one of {allowed}"
        ) from None


def encode_wait(value: str | None) -> EncodeWait:
    """An encode's ``wait``: absent is ``published``."""
    return enum_param(EncodeWait, "wait", value, EncodeWait.PUBLISHED)


def encode_video_for(value: str | None) -> VideoFor:
    """An encode's ``video_for`` (:class:`~vitserve.media.VideoFor`): absent is ``model``."""
    return enum_param(VideoFor, "video_for", value, VideoFor.MODEL)


class BodyReader:
    """Reads request bodies and checks encode requests' items under ``limits`` (module)."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="vitserve-read")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the reader's threads (CPU work of up to ``max_request_bytes``)."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, fn, *args)

    async def read(
        self, request: Request, terms: Terms, wait: EncodeWait, video_for: VideoFor
    ) -> tuple[list[bytes | str], list[int]]:
        """An HTTP request's items (image bytes or keys) and each one's patches (0 for a key),
        checked; the body refused while it is read once it passes ``max_request_bytes`` or
        takes longer than ``body_timeout_s``."""
        limits = self.limits
        body = await parse.read_body(request, limits.max_request_bytes, limits.body_timeout_s)
        if not body:
            raise MalformedRequestError(
                "empty request body; send images as multipart/form-data "
                f"or JSON {parse.ENCODE_SHAPE}"
            )
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            items = await self._form_items(request, body)
            return items, await self.check(items, terms, wait, video_for)
        if parse.is_json_type(ctype):
            return await self.off_loop(self._json_items, body, terms, wait, video_for)
        raise MalformedRequestError(
            f"unsupported content type {ctype[:80]!r}; use multipart/form-data or JSON", 415
        )

    async def check(
        self, items: list[bytes | str], terms: Terms, wait: EncodeWait, video_for: VideoFor
    ) -> list[int]:
        """``items`` checked (module), off the loop; each item's patches (0 for a key)."""
        return list(await self.off_loop(self._checked, items, terms, wait, video_for))

    def _json_items(
        self, body: bytearray, terms: Terms, wait: EncodeWait, video_for: VideoFor
    ) -> tuple[list[bytes | str], list[int]]:
        """A JSON encode body's items and their patches, checked (a reader thread)."""
        items = parse.encode_json_bytes(body, self.limits.max_images_per_request)
        return items, self._checked(items, terms, wait, video_for)

    async def _form_items(self, request: Request, body: bytes | bytearray) -> list[bytes | str]:
        """The image files of a multipart ``body`` (already read), then its video files (field
        ``videos``), at most the item limit parsed."""
        limits = self.limits
        ctype = request.headers.get("content-type", "")

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        items: list[bytes | str] = []
        try:
            async with Request(request.scope, replay).form(
                max_files=limits.max_images_per_request,
                max_fields=16,
                max_part_size=max(limits.max_image_bytes, limits.max_video_bytes) + 1,
            ) as form:
                for field in parse.ENCODE_FIELDS:
                    for i, upload in enumerate(form.getlist(field)):
                        if isinstance(upload, str):
                            raise MalformedRequestError(f"multipart field {field!r} must be a file")
                        items.append(parse.check_media(await upload.read(), field, i))
                unknown = set(form.keys()) - set(parse.ENCODE_FIELDS)
        except (HTTPException, MultiPartException) as exc:
            reason = str(getattr(exc, "detail", None) or getattr(exc, "message", exc))
            if reason.startswith("Too many files"):  # refused at the limit's next file
                allowed = limits.max_images_per_request
                sent = max(parse.multipart_parts(body, ctype), allowed + 1)
                raise LimitExceededError("max_images_per_request", sent, allowed) from None
            raise MalformedRequestError(f"unreadable multipart body: {reason}") from None
        if unknown:
            raise MalformedRequestError(f"unknown multipart fields: {sorted(unknown)}")
        return items

    def _checked(
        self, items: list[bytes | str], terms: Terms, wait: EncodeWait, video_for: VideoFor
    ) -> list[int]:
        """The request-level limits: image count, total bytes, each image's bytes and pixels
        (from its header), and the request's work against one encoder replica's capacity, as
        the encoder's admission counts it: a request no replica could ever admit is a 413
        here. A video is sampled ``video_for``'s way."""
        parse.check_items(items, self.limits)
        strict = wait is EncodeWait.CLAIMED
        limits, videos = self.limits.image_limits(), self.limits.video_limits()
        sampling = terms.sampling(video_for)
        works = {
            i: image_work(terms.rule, item, i, limits, strict, video=sampling, video_limits=videos)
            for i, item in enumerate(items)
            if isinstance(item, bytes)
        }
        check_fits(terms.capacity, *request_cost(works.values(), decoding=True))
        return [works[i].patches if i in works else 0 for i in range(len(items))]


__all__ = ["BodyReader", "encode_video_for", "encode_wait", "enum_param"]
