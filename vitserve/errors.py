"""The one exception hierarchy of vitserve.

Every error vitserve raises on purpose derives from :class:`VitserveError`. Subclasses carry
structured fields (never only a message) and say, through ``retryable``, whether trying the same
call again can help. The HTTP layer maps ``http_status`` to a response code.
"""

from __future__ import annotations

import re

# What an answer never carries: URLs (with their credentials, hosts and paths), IP addresses and
# ``host:port`` pairs (a host with a letter or a dot in it: ``redis-0.svc:6379``, not ``3:12``).
_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+"  # a URL
    r"|\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\](?::\d+)?"  # [IPv6]:port (a colon inside: not [0])
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?=[\w.-]*[A-Za-z.])[\w.-]+:\d{2,5}\b"  # host:port
)


def public_text(text: str) -> str:
    """``text`` with every network address replaced by ``<address>``: what an error answer
    may say about the service's insides."""
    return _ADDRESS.sub("<address>", text)


class VitserveError(Exception):
    """Root of every error vitserve raises on purpose."""

    retryable: bool = False
    http_status: int = 500

    def to_dict(self) -> dict[str, object]:
        """A JSON-able description: the class name, the message and the structured fields, as
        answered to callers: every network address in their text (URLs, ``host:port``, IP
        addresses) replaced by ``<address>`` (:func:`public_text`); the log keeps ``str(exc)``.
        It holds OpenAI's (and vLLM's) error fields too, ``code`` (the HTTP status) and
        ``param`` (None), so every error an OpenAI client meets through vitserve, its own or
        vLLM's passed through, has one shape: ``{"error": {message, type, param, code, ...}}``."""
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        described = {
            "type": type(self).__name__,
            "message": str(self),
            "param": None,
            "code": self.http_status,
            **fields,
        }
        return {k: public_text(v) if isinstance(v, str) else v for k, v in described.items()}

    def __reduce__(self) -> tuple[object, ...]:
        """Rebuilt from its message and fields, not by calling ``__init__`` with its message
        alone (what Python does by default, which fails for every subclass with fields): a
        replica's error reaches its caller through Ray as itself, not as Ray's
        ``UnserializableException``."""
        return (_rebuild, (type(self), self.args, dict(vars(self))))


def _rebuild(
    cls: type[VitserveError], args: tuple[object, ...], fields: dict[str, object]
) -> VitserveError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(fields)
    return exc


class ConfigError(VitserveError):
    """A setting or argument is invalid (unknown dtype, device, preset, ...)."""

    http_status = 422


class ModelLoadError(VitserveError):
    """A model could not be loaded: unknown family, missing files, tensors that do not match."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"cannot load model {model!r}: {reason}")
        self.model = model
        self.reason = reason


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is of a model family vitserve has no adapter for."""

    http_status = 422


class ImageError(VitserveError):
    """An input image was refused. ``index`` is its position in the call's image list."""

    http_status = 422

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: {reason}")
        self.index = index
        self.reason = reason


class ImageDecodeError(ImageError):
    """The bytes are not an image vitserve can decode (empty, truncated, unknown format)."""


class VideoDecodeError(ImageDecodeError):
    """The bytes are not a video vitserve can decode (format, codec, a header that does not
    bound its decode, a corrupt or truncated stream)."""


class ImageTooLargeError(ImageError):
    """The image exceeds a configured limit; checked before the pixels are decoded.

    ``limit`` names the limit (``max_image_bytes`` or ``max_image_pixels``), ``value`` is what
    the image has and ``allowed`` what the limit allows (the fields of LimitExceededError).
    """

    http_status = 413

    def __init__(self, index: int, limit: str, value: int, allowed: int) -> None:
        super().__init__(index, f"{limit} exceeded: {value} > {allowed}")
        self.limit = limit
        self.value = value
        self.allowed = allowed


class ImagePreprocessError(ImageError):
    """The image decoded but the model's image processor could not turn it into patches."""


class StoreError(VitserveError):
    """An embedding store failed."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached (down, timed out, refused); trying again later can help."""

    retryable = True
    http_status = 503

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"store {store} unavailable: {reason}")
        self.store = store
        self.reason = reason


class CacheMissError(StoreError):
    """Embeddings a caller needs are not in the store (never stored, evicted or corrupt)."""

    http_status = 404

    def __init__(self, keys: list[str]) -> None:
        super().__init__(
            f"{len(keys)} key(s) not in the store: {', '.join(k[:16] for k in keys[:4])}"
        )
        self.keys = keys


class StoreSplitError(StoreError):
    """Two parts of one application hold their claims and entries in different places (a
    node-local store on two nodes): neither finds what the other publishes, and single flight
    cannot hold. A deployment to fix, not a request to retry."""

    def __init__(self, here: str, there: str) -> None:
        super().__init__(
            f"the store is split: claims here live in {here}, the caller's in {there} (a "
            "node:// store on two nodes?); on several nodes use a shared store, e.g. "
            "tiered://?l1=node://&l2=redis://... (or redis+cluster://...)"
        )
        self.here = here
        self.there = there


class RecordFormatError(StoreError):
    """A stored value is not a valid record (stores count it as a miss; never raised to users
    of ``get``)."""

    def __init__(self, reason: str, *, newer_version: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.newer_version = newer_version  # written by a newer vitserve: not corrupt


class RequestError(VitserveError):
    """A request refused as a whole, before any work was done."""


class LimitExceededError(RequestError):
    """A request exceeds a configured limit (``limit`` names it)."""

    http_status = 413

    def __init__(self, limit: str, value: int, allowed: int) -> None:
        super().__init__(f"{limit} exceeded: {value} > {allowed}")
        self.limit = limit
        self.value = value
        self.allowed = allowed


class RequestTimeoutError(RequestError):
    """A request's body did not arrive whole in time (HTTP 408): ``limit`` names the setting,
    ``seconds`` is its value, ``received`` the bytes that had arrived."""

    http_status = 408

    def __init__(self, limit: str, seconds: float, received: int) -> None:
        super().__init__(
            f"the request body did not arrive within {limit} ({seconds:g} s; "
            f"{received} bytes received)"
        )
        self.limit = limit
        self.seconds = seconds
        self.received = received


class AuthenticationError(RequestError):
    """A request without a bearer token, or with one the service does not know (HTTP 401,
    answered with ``WWW-Authenticate: Bearer``). ``reason``: ``missing`` or ``invalid``."""

    http_status = 401

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(
            message
            or (
                "this service needs a bearer token (Authorization: Bearer <token>)"
                if reason == "missing"
                else "the bearer token is not valid here"
            )
        )
        self.reason = reason

    @property
    def challenge(self) -> str:
        """The ``WWW-Authenticate`` header of the answer (RFC 6750)."""
        if self.reason == "missing":
            return 'Bearer realm="vitserve"'
        return 'Bearer realm="vitserve", error="invalid_token"'


class PromptTooLongError(RequestError):
    """The prompt (with the completion asked for) does not fit the model's context."""

    http_status = 400

    def __init__(self, tokens: int, allowed: int, detail: str = "") -> None:
        super().__init__(
            f"{detail or 'the prompt has'} {tokens} tokens; the model's context holds {allowed}"
        )
        self.tokens = tokens
        self.allowed = allowed


class MalformedRequestError(RequestError):
    """A request that cannot be read (bad JSON, base64, content type, key or range)."""

    http_status = 422

    def __init__(self, reason: str, status: int = 422) -> None:
        super().__init__(reason)
        self.reason = reason
        self.http_status = status


class ServiceUnavailableError(VitserveError):
    """A part of the service cannot answer now (an encoder replica restarting, the ingress
    unreachable); trying again later can help."""

    retryable = True
    http_status = 503

    def __init__(self, component: str, reason: str) -> None:
        super().__init__(f"{component} unavailable: {reason}")
        self.component = component
        self.reason = reason


class ApiError(VitserveError):
    """An error answer of the service that the client has no class for (another version's
    error type, or a body that is not vitserve's error shape: a proxy's page, ...)."""

    def __init__(self, status: int, type_name: str, message: str) -> None:
        super().__init__(f"HTTP {status} {type_name}: {message}".replace("  ", " "))
        self.http_status = status
        self.type_name = type_name
        self.retryable = status in (429, 503)


class InternalError(VitserveError):
    """An unexpected failure inside the service (a bug, never the caller's input): the API's
    500, in its error shape, logged with its traceback where it happened."""

    def __init__(self, exception: str) -> None:
        super().__init__(f"internal error ({exception}); the service's log has the traceback")
        self.exception = exception


def actor_unavailable_errors() -> tuple[type[Exception], ...]:
    """Ray's errors for a replica that died, restarts or cannot be reached (importing Ray only
    when called): what both the ingress and the client's handle transport turn into a
    retryable :class:`ServiceUnavailableError`."""
    # heavy, and absent from the client-only install, which imports this module too
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)


class QuotaExceededError(VitserveError):
    """A tenant is over one of its quotas (``quota``: its name, ``requests_per_s``;
    ``limit`` in its unit); other tenants are not. The rate refills: retrying after
    ``retry_after_s`` can help."""

    http_status = 429

    def __init__(self, quota: str, tenant: str | None, limit: float, retry_after_s: float) -> None:
        who = f"tenant {tenant!r}" if tenant else "this caller"
        super().__init__(f"{who} is over its quota {quota} = {limit:g}")
        self.quota = quota
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.retryable = retry_after_s > 0


class BackpressureError(VitserveError):
    """The service is at capacity (its queue is full); retry after a pause."""

    retryable = True
    http_status = 429

    def __init__(self, queued: int, limit: int, detail: str = "") -> None:
        super().__init__(f"at capacity ({queued}/{limit} queued){': ' + detail if detail else ''}")
        self.queued = queued
        self.limit = limit
