"""Reading the HTTP API's requests: from a body (or a parsed JSON value) to what a route works
on, or the error naming what is wrong. No Ray and no store: the ingress and the prefill
application call these, and tests drive them alone (``tests/fuzz/test_request_parsing.py``).

Invariants:

* Whatever the input (any bytes, any JSON value, any query value), each function returns what
  it documents or raises :class:`~vitserve.errors.MalformedRequestError` (422; 415 for a content
  type) or :class:`~vitserve.errors.LimitExceededError` (413), naming the problem; never another
  exception (a JSON document nested too deeply is a 422, not Python's ``RecursionError``).
* Limits are checked before the work they bound: a body is refused while it is read, once it
  passes ``max_request_bytes`` (a chunked body without ``Content-Length`` included) or its
  ``body_timeout_s`` (408), a JSON document by its count of values before it is parsed, and
  an item count before any item is decoded (a 10k-image JSON request costs a ``len``).
* A key is 64 lowercase hex characters; a row range is ``[start, end)`` with
  ``0 <= start < end`` (integers, never booleans); whether ``end`` is past the image's tokens
  only the store's header can say.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from typing import Any, NoReturn, Protocol

from starlette.requests import ClientDisconnect

from vitserve.client.handles import EncodeWait
from vitserve.errors import LimitExceededError, MalformedRequestError, RequestTimeoutError
from vitserve.media import Media, VideoFor, media_of

KEY_RE = re.compile(r"^[0-9a-f]{64}$")
KEY_SCHEMA = {"type": "string", "pattern": KEY_RE.pattern}
# An image inlined in a chat message (OpenAI's image_url), as the prefill app and the vLLM front
# read it: only base64 data: URLs carry bytes.
DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<b64>;base64)?,(?P<data>.*)$", re.S)

Item = bytes | str  # an image's bytes, or the key of an image the caller believes held
Read = tuple[str, int, int]  # (key, start, end): rows [start, end) of one image


class Limits(Protocol):
    """The request limits these functions check (``config.LimitsConfig`` has them)."""

    @property
    def max_images_per_request(self) -> int: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_videos_per_request(self) -> int: ...


# -- bodies ---------------------------------------------------------------------------------
def content_length(header: str | None, limit: int, name: str = "max_request_bytes") -> None:
    """Refuse a declared ``Content-Length`` over ``limit`` (or one that is not a count)."""
    if header is None:
        return
    if not re.fullmatch(r"[0-9]+", header.strip()):
        raise MalformedRequestError(f"Content-Length {header[:40]!r} is not a byte count", 400)
    if int(header) > limit:
        raise LimitExceededError(name, int(header), limit)


async def read_body(
    request: Any, limit: int, timeout_s: float | None = None, name: str = "max_request_bytes"
) -> bytearray:
    """The body of a Starlette ``request``, refused (413 naming ``name``) as soon as it passes
    ``limit`` bytes, declared or read: a chunked body without ``Content-Length`` is never
    buffered whole; and refused (408) when it has not arrived whole within ``timeout_s`` (a
    slow client does not hold a slot of the replica for longer). Gathered chunk by chunk into
    one buffer: no join of the whole body at the end, one C call that holds the interpreter
    lock for as long as it copies (``loadtest/results/body-reading-cpu.md``)."""
    content_length(request.headers.get("content-length"), limit, name)
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise LimitExceededError(name, len(body) + len(chunk), limit)
            body.extend(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except ClientDisconnect:
        raise MalformedRequestError("the client disconnected before the body ended", 400) from None
    except asyncio.TimeoutError:
        raise RequestTimeoutError("body_timeout_s", timeout_s or 0.0, len(body)) from None
    return body


def is_json_type(ctype: str) -> bool:
    """``application/json`` (with parameters) or a ``+json`` type."""
    mime = ctype.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


def json_type(ctype: str | None) -> None:
    """A JSON route takes a JSON content type, or none named: 415 for any other."""
    if ctype and not is_json_type(ctype):
        raise MalformedRequestError(
            f"unsupported content type {ctype[:80]!r}; send JSON (application/json)", 415
        )


#: the fewest JSON values a body may hold before it is refused unparsed: parsed, they take a
#: few MB at most, and a request with too many items is then refused naming its item limit
JSON_VALUES_FLOOR = 65_536


def json_body_limit(items: int) -> int:
    """The most bytes a JSON body of up to ``items`` keys or reads may take: 4 KiB an item (a
    read, the longest, is ~80 bytes; the rest is room for whitespace), a few MiB at most for
    the probe and rows routes, whose parse then stays cheap, where ``max_request_bytes`` is
    sized for images."""
    return 4096 * items + 65536


def json_values_allowed(items: int) -> int:
    """The most JSON values a body for requests of up to ``items`` items may hold: each item
    (an image, a key, a read) is at most a container and three values, plus the document's
    own few, and at least ``JSON_VALUES_FLOOR``."""
    return max(4 * items + 16, JSON_VALUES_FLOOR)


#: bytes scanned per C call where a body is scanned whole: each call holds the interpreter lock,
#: and the event loop waits for it (``loadtest/results/body-reading-cpu.md``)
SCAN_STEP = 2**20


def json_values(body: bytes | bytearray) -> int:
    """An upper bound of the values a JSON document holds, counted without parsing it (C
    speed, ``SCAN_STEP`` at a time): every value but the first follows a comma or opens a
    container. Valid requests of this API never hold a comma or bracket inside a string (keys
    are hex, images base64)."""
    return 1 + sum(
        body.count(c, i, i + SCAN_STEP)
        for i in range(0, len(body), SCAN_STEP)
        for c in (b",", b"[", b"{")
    )


def _not_json(constant: str) -> NoReturn:
    """``json.loads`` reads ``NaN``, ``Infinity`` and ``-Infinity``, which JSON (RFC 8259) has
    not: a body holding one is refused as invalid JSON, like any other client's parser would."""
    raise ValueError(f"{constant} is not a JSON value")


def json_body(body: bytes | bytearray, max_values: int | None = None) -> Any:
    """The JSON value of a body (422 naming why it is not one). With ``max_values``, a body
    holding more values than that (``json_values``) is refused (413) before it is parsed:
    parsing a JSON document costs memory by its values (a few MB of ``[0,0,...`` takes
    hundreds of MB as Python objects), not by its bytes."""
    if not body or body.isspace():
        raise MalformedRequestError("empty request body; expected a JSON document")
    if max_values is not None and (values := json_values(body)) > max_values:
        raise LimitExceededError("json_values", values, max_values)
    try:
        return json.loads(body, parse_constant=_not_json)
    except RecursionError:
        raise MalformedRequestError("invalid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digits over the limit
        raise MalformedRequestError(f"invalid JSON: {str(exc)[:200]}") from None


def multipart_parts(body: bytes | bytearray, ctype: str) -> int:
    """How many parts a multipart ``body`` holds, counted by its boundary (0 without one):
    what a request refused at the image limit's next file really sent."""
    match = re.search(r'boundary="?([^";]+)"?', ctype)
    if match is None:
        return 0
    return max(body.count(b"--" + match.group(1).encode("latin-1", "replace")) - 1, 0)


# -- /v1/encode ------------------------------------------------------------------------------
ENCODE_SHAPE = (
    '{"images": [{"data": "<base64>"} | {"key": "<64 hex>"}, ...], "videos": [...] (optional)}'
)
#: the fields of an encode request that hold items, in the order their items are answered
ENCODE_FIELDS = ("images", "videos")
_CONTAINERS = "an MP4/MOV, Matroska/WebM or AVI container"


def _count(items: Any, limit: int, name: str = "max_images_per_request") -> None:
    if len(items) > limit:
        raise LimitExceededError(name, len(items), limit)


def encode_json(doc: Any, max_images: int) -> list[Item]:
    """``/v1/encode``'s JSON document -> its items (image or video bytes, or keys): the
    images, then the videos, each in order; the item count checked before any base64 is
    decoded, each item's kind against its field (:func:`check_media`)."""
    if (
        not isinstance(doc, dict)
        or not doc
        or set(doc) - set(ENCODE_FIELDS)
        or not all(isinstance(v, list) for v in doc.values())
    ):
        raise MalformedRequestError(f"expected {ENCODE_SHAPE}")
    _count([i for f in ENCODE_FIELDS for i in doc.get(f, ())], max_images)
    items: list[Item] = []
    for name in ENCODE_FIELDS:
        for i, item in enumerate(doc.get(name, ())):
            if isinstance(item, dict) and len(item) == 1:
                [(field, value)] = item.items()
                if field in ("data", "key") and isinstance(value, str):
                    items.append(check_media(_encode_item(i, field, value, name), name, i))
                    continue
            raise MalformedRequestError(f'{name}[{i}] must be {{"data": ...}} or {{"key": ...}}')
    return items


def check_media(item: Item, field: str, index: int) -> Item:
    """``item`` of ``field`` (``images`` or ``videos``) at ``index``, or 422 when its bytes
    are the other kind (:func:`vitserve.media.media_of`): a video sent as an image or the
    reverse is refused at the door, naming where it is, not decoded as the wrong thing."""
    if isinstance(item, str):
        return item  # a key: what it names was checked when it was encoded
    video = media_of(item) is Media.VIDEO
    if field == "videos" and not video:
        raise MalformedRequestError(f"{field}[{index}] is not a video ({_CONTAINERS})")
    if field != "videos" and video:
        raise MalformedRequestError(f"{field}[{index}] is a video; send it in 'videos'")
    return item


def _encode_item(i: int, field: str, value: str | memoryview, name: str = "images") -> Item:
    """Item ``i`` of an encode document's ``name`` list: ``data`` (base64) as its bytes, or a
    ``key``."""
    if field == "key":
        text = value if isinstance(value, str) else bytes(value).decode("ascii")
        return key(text, f"{name}[{i}].key")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRequestError(f"{name}[{i}].data is not base64") from None


# One item of an encode document as JSON writers lay it out (no escapes: base64 and hex have
# none): ``{"data": "..."}`` or ``{"key": "..."}``, then a comma or the list's end.
_ENCODE_HEAD = re.compile(rb'\s*\{\s*"images"\s*:\s*\[')
_ENCODE_ITEM = re.compile(rb'\s*\{\s*"(data|key)"\s*:\s*"([A-Za-z0-9+/=]*)"\s*\}\s*(,|\])')
_ENCODE_TAIL = re.compile(rb"\s*\}\s*")
_EMPTY_LIST = re.compile(rb"\s*\]")


def encode_json_bytes(body: bytes | bytearray, max_images: int) -> list[Item]:
    """``encode_json(json_body(body), max_images)``, without parsing the document whole when
    it is laid out as writers lay it out: item by item (each image's base64 scanned and decoded
    in its own C calls, so a 64 MiB body never holds the interpreter lock for long, where one
    ``json.loads`` of it holds it throughout: ``loadtest/results/body-reading-cpu.md``). Any
    other layout (escapes, other fields, another shape) is parsed by ``json_body`` and read by
    ``encode_json``: the same answer either way."""
    items = _encode_items(body, max_images)
    if items is None:
        return encode_json(json_body(body, json_values_allowed(max_images)), max_images)
    return items


def _encode_items(body: bytes | bytearray, max_images: int) -> list[Item] | None:
    """The fast path of ``encode_json_bytes``; None when the layout is not the usual one."""
    head = _ENCODE_HEAD.match(body)
    if head is None:
        return None
    pos, spans = head.end(), []
    if (empty := _EMPTY_LIST.match(body, pos)) is not None:
        pos = empty.end()
    else:
        while True:
            item = _ENCODE_ITEM.match(body, pos)
            if item is None:
                return None
            spans.append((item.group(1).decode(), item.start(2), item.end(2)))
            pos = item.end()
            if item.group(3) == b"]":
                break
    tail = _ENCODE_TAIL.match(body, pos)
    if tail is None or tail.end() != len(body):
        return None
    _count(spans, max_images)  # before any base64 is decoded
    view = memoryview(body)  # each image's base64 decoded where it lies, not copied first
    return [
        check_media(_encode_item(i, field, view[start:end]), "images", i)
        for i, (field, start, end) in enumerate(spans)
    ]


def encode_payload(payload: Any, max_images: int) -> list[Item]:
    """``Ingress.call("encode", ...)``'s payload ``{"images": [bytes | key, ...], "videos":
    [...]}`` (either list may be left out) -> items: the images, then the videos."""
    if (
        not isinstance(payload, dict)
        or not payload
        or set(payload) - set(ENCODE_FIELDS)
        or not all(isinstance(v, list) for v in payload.values())
    ):
        raise MalformedRequestError(
            'expected {"images": [bytes | 64-hex key, ...], "videos": [...]}'
        )
    _count([i for f in ENCODE_FIELDS for i in payload.get(f, ())], max_images)
    items: list[Item] = []
    for name in ENCODE_FIELDS:
        for i, item in enumerate(payload.get(name, ())):
            if isinstance(item, str):
                key(item, f"{name}[{i}]")
            elif not isinstance(item, bytes):
                raise MalformedRequestError(f"{name}[{i}] must be bytes or a 64-hex key")
            items.append(check_media(item, name, i))
    return items


def check_items(items: list[Item], limits: Limits) -> None:
    """The request-level limits of an encode: at least one image, the image count, the total
    bytes (each image's own byte and pixel limits are the image header's to check)."""
    if not items:
        raise MalformedRequestError("no images in the request")
    _count(items, limits.max_images_per_request)
    videos = [i for i in items if isinstance(i, bytes) and media_of(i) is Media.VIDEO]
    _count(videos, limits.max_videos_per_request, "max_videos_per_request")
    total = sum(len(i) for i in items if isinstance(i, bytes))
    if total > limits.max_request_bytes:
        raise LimitExceededError("max_request_bytes", total, limits.max_request_bytes)


# -- keys, /v1/probe, /v1/rows, row ranges ---------------------------------------------------
def key(value: Any, where: str = "key") -> str:
    """A 64-hex key, or 422 naming ``where`` it was."""
    if not isinstance(value, str) or not KEY_RE.match(value):
        raise MalformedRequestError(f"{where} is not a 64-hex key (64 characters 0-9a-f)")
    return value


def probe(doc: Any, max_keys: int) -> tuple[list[str], bool]:
    """``{"keys": [...], "headers": false}`` -> ``(keys, headers)``."""
    if not isinstance(doc, dict) or not set(doc) <= {"keys", "headers"} or "keys" not in doc:
        raise MalformedRequestError('expected {"keys": [...], "headers": false}')
    keys, with_headers = doc["keys"], doc.get("headers", False)
    if not isinstance(keys, list):
        raise MalformedRequestError("keys must be a list of 64-hex keys")
    if not isinstance(with_headers, bool):
        raise MalformedRequestError("headers must be true or false")
    _count(keys, max_keys, "max_keys_per_probe")
    return [key(k, f"keys[{i}]") for i, k in enumerate(keys)], with_headers


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def row_range(start: Any, end: Any) -> tuple[int, int | None]:
    """A fetch's ``?start=&end=`` (None: absent) -> ``(start, end)``, ``end`` None for the
    image's last row."""
    if any(v is not None and not _int(v) for v in (start, end)):
        raise MalformedRequestError("start and end must be integers")
    start = start or 0
    if start < 0:
        raise MalformedRequestError(f"start {start} is negative")
    if end is not None and end <= start:
        raise MalformedRequestError(f"row range [{start}, {end}) is empty or reversed")
    return start, end


def rows(doc: Any, max_reads: int) -> list[Read]:
    """``{"reads": [[key, start, end], ...]}`` -> the reads (each range as ``row_range``)."""
    reads = doc.get("reads") if isinstance(doc, dict) else None
    if not isinstance(reads, list) or set(doc) != {"reads"}:
        raise MalformedRequestError('expected {"reads": [[key, start, end], ...]}')
    _count(reads, max_reads, "max_keys_per_probe")
    out: list[Read] = []
    for i, read in enumerate(reads):
        if not isinstance(read, (list, tuple)) or len(read) != 3:
            raise MalformedRequestError(f"reads[{i}] must be [key, start, end]")
        if not _int(read[1]) or not _int(read[2]):
            raise MalformedRequestError(f"reads[{i}]: start and end must be integers")
        try:
            start, end = row_range(read[1], read[2])
        except MalformedRequestError as exc:
            raise MalformedRequestError(f"reads[{i}]: {exc.reason}") from None
        out.append((key(read[0], f"reads[{i}][0]"), start, end))  # type: ignore[arg-type]
    return out


# -- OpenAPI: request bodies of the routes that read their body themselves ---------------------
def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_ENCODE_ITEM_SCHEMA = {
    "oneOf": [
        {
            "type": "object",
            "required": ["data"],
            "additionalProperties": False,
            "properties": {
                "data": {"type": "string", "format": "byte", "description": "the file, base64"}
            },
        },
        {
            "type": "object",
            "required": ["key"],
            "additionalProperties": False,
            "properties": {"key": {**KEY_SCHEMA, "description": "an item already encoded"}},
        },
    ]
}
_VIDEOS = "videos (MP4/MOV, Matroska/WebM, AVI), answered after the images"
ENCODE_OPENAPI = {
    "parameters": [
        {
            "name": "wait",
            "in": "query",
            "required": False,
            "description": "published: answered once the new images are encoded and published; "
            "claimed: once they are claimed, each item {key, pending: true}",
            "schema": {
                "type": "string",
                "enum": [w.value for w in EncodeWait],
                "default": EncodeWait.PUBLISHED.value,
            },
        },
        {
            "name": "video_for",
            "in": "query",
            "required": False,
            "description": "whose frame sampling the videos are encoded and keyed under: the "
            "checkpoint's video processor's (model) or vLLM's loader's for the family (vllm)",
            "schema": {
                "type": "string",
                "enum": [v.value for v in VideoFor],
                "default": VideoFor.MODEL.value,
            },
        },
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {
                        "images": {"type": "array", "items": _ENCODE_ITEM_SCHEMA},
                        "videos": {
                            "type": "array",
                            "description": _VIDEOS,
                            "items": _ENCODE_ITEM_SCHEMA,
                        },
                    },
                }
            },
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "images": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                        },
                        "videos": {
                            "type": "array",
                            "description": _VIDEOS,
                            "items": {"type": "string", "format": "binary"},
                        },
                    },
                }
            },
        },
    },
}


def inlined_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic model's JSON schema with its ``$defs`` written in where each is referred to
    (an operation's OpenAPI body cannot refer to definitions of its own); recursion is an
    error."""
    defs = schema.get("$defs", {})

    def inline(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.rsplit("/", 1)[1]
                if name in seen:
                    raise ValueError(f"{name} refers to itself: it cannot be inlined")
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**inline(defs[name], (*seen, name)), **inline(rest, seen)}
            return {k: inline(v, seen) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [inline(v, seen) for v in node]
        return node

    return inline(schema, ())


def body_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """An operation's ``openapi_extra``: a required JSON body of ``schema``."""
    return {"requestBody": _json_body(schema)}


CHAT_OPENAPI = {
    "requestBody": _json_body(
        {
            "type": "object",
            "required": ["messages"],
            "description": "OpenAI's chat completion request: messages whose content parts "
            "may be images (image_url, a data: URL) and videos (video_url); the sampling "
            "fields (max_tokens, temperature, stream, ...) as OpenAI defines them",
            "properties": {
                "model": {"type": "string"},
                "messages": {"type": "array", "items": {"type": "object"}},
                "stream": {"type": "boolean", "default": False},
                "max_tokens": {"type": "integer", "minimum": 1},
            },
        }
    )
}
PROBE_OPENAPI = {
    "requestBody": _json_body(
        {
            "type": "object",
            "required": ["keys"],
            "additionalProperties": False,
            "properties": {
                "keys": {"type": "array", "items": KEY_SCHEMA},
                "headers": {"type": "boolean", "default": False},
            },
        }
    )
}
ROWS_OPENAPI = {
    "requestBody": _json_body(
        {
            "type": "object",
            "required": ["reads"],
            "additionalProperties": False,
            "properties": {
                "reads": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "minItems": 3,
                        "maxItems": 3,
                        "prefixItems": [
                            KEY_SCHEMA,
                            {"type": "integer", "minimum": 0},
                            {"type": "integer", "minimum": 1},
                        ],
                        "items": False,
                        "description": "[key, start, end]: rows [start, end) of one image",
                    },
                }
            },
        }
    )
}


__all__ = [
    "CHAT_OPENAPI",
    "ENCODE_OPENAPI",
    "KEY_RE",
    "PROBE_OPENAPI",
    "ROWS_OPENAPI",
    "body_openapi",
    "check_items",
    "content_length",
    "encode_json",
    "encode_json_bytes",
    "encode_payload",
    "inlined_schema",
    "is_json_type",
    "json_body",
    "json_body_limit",
    "json_type",
    "json_values",
    "json_values_allowed",
    "key",
    "multipart_parts",
    "probe",
    "read_body",
    "row_range",
    "rows",
]
