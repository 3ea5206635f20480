"""The request/response core of both clients: every operation, with the I/O left out.

Each operation (:meth:`ClientCore.encode`, ``fetch_chunk``, ``fetch``, ``probe``) is a
generator that yields what it needs done, an :class:`ApiCall` (through the client's transport:
HTTP to the ingress, or a Serve handle) or a :class:`StoreCall` (a method of the direct store),
and is sent the answer back; its return value is the operation's result. ``EncoderClient``
performs the yields with blocking I/O, ``AsyncEncoderClient`` awaits them: only the I/O differs
(the httpx / redis-py manner), and the retry loop is written once (:func:`retried`, deciding
by :func:`retry_delay`).

Invariants:

* **Hash first.** Keys are computed here exactly as the service computes them
  (:func:`vitserve.keys.content_key` over the bytes, with the fingerprint and namespace the
  service reports once on ``/healthz``). Only images the store lacks are uploaded; an
  all-cached ``encode`` makes no encoder call.
* A fetch returns the checked rows or raises. Rows the direct store cannot serve (it is down,
  or lacks them: evicted there, or held only in the service's local tier) are read through the
  service, whose store is where the encoder publishes; an entry gone there too is encoded again
  when its handle still holds the image, else :class:`~vitserve.errors.CacheMissError` names
  every key missing (so one retry after re-encoding them recovers); one the service encoded
  again but could not store (its store unavailable: the answer says ``published: false``) is a
  retryable :class:`~vitserve.errors.StoreUnavailableError`, never a miss. Never wrong data: the
  store checks every block's checksum, key and fingerprint.
* Retries only for what can help (429, 503, a dropped connection, a store that is down), with
  exponential backoff, honouring ``Retry-After``; every failure reaches the caller as a
  :class:`~vitserve.errors.VitserveError`.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import vitserve.errors as errors
from vitserve.cache.base import EmbeddingStore
from vitserve.cache.codec import EmbeddingRecord, Header, decode_record
from vitserve.cache.urls import open_store
from vitserve.client.chunks import item_spans, plan_chunk
from vitserve.client.handles import EncodeWait, FetchedChunk, ImageHandle, Submitted
from vitserve.client.inputs import ImageInput, image_bytes
from vitserve.client.metrics import ClientMetrics
from vitserve.errors import CacheMissError, ConfigError, StoreUnavailableError, VitserveError
from vitserve.keys import item_key, video_settings
from vitserve.media import Media, VideoFor, media_of

RETRY_STATUSES = frozenset({429, 503})
HEADER_CACHE_SIZE = 4096  # record headers kept for row reads (a few KiB each at most)


@dataclass(frozen=True, slots=True)
class ApiCall:
    """A call of the service's API: ``healthz``, ``probe``, ``encode`` or ``rows``."""

    route: str
    payload: Any = None


@dataclass(frozen=True, slots=True)
class StoreCall:
    """A call of a method of the direct store (blocking: the async client runs it in a
    thread). ``fallback``: the core has another way (the service) when it fails retryably
    (see :func:`falls_back`)."""

    method: str
    args: tuple[Any, ...]
    fallback: bool = False


@dataclass(frozen=True, slots=True)
class Reply:
    """A transport's answer: the status, the JSON body (or the record bytes of ``rows``)."""

    status: int
    body: Any
    retry_after: float | None = None


Op = ApiCall | StoreCall
Flow = Generator[Op, Any, Any]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to retry a retryable failure (429, 503, a dropped connection,
    a store that is down): ``attempts`` tries in all, exponential backoff with jitter from
    ``backoff_s`` up to ``max_backoff_s``; a ``Retry-After`` is honoured up to
    ``max_retry_after_s``."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ConfigError(f"invalid retry policy {self}")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 0)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after_s)
        backoff = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return backoff * random.uniform(0.5, 1.0)


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the HTTP-date form is not used by vitserve)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def retry_delay(policy: RetryPolicy, attempt: int, outcome: Any) -> float | None:
    """Seconds to wait before trying again after try ``attempt`` (from 0) ended in
    ``outcome`` (an answer or the VitserveError raised); None: do not retry (it succeeded, it
    cannot help, or the tries are spent; the caller then returns or raises the outcome). A
    :class:`Reply` with a retryable status comes back as it is once the tries are spent (the
    core then raises its error)."""
    if attempt >= policy.attempts - 1:
        return None
    if isinstance(outcome, VitserveError):
        return policy.delay(attempt) if outcome.retryable else None
    if isinstance(outcome, Reply) and outcome.status in RETRY_STATUSES:
        return policy.delay(attempt, outcome.retry_after)
    return None


def falls_back(op: Any, outcome: Any) -> bool:
    """Whether ``outcome`` is a retryable failure (the store down) of a store call with a
    ``fallback``: the clients then hand it to the core at once, neither retried nor raised."""
    return (
        isinstance(op, StoreCall)
        and op.fallback
        and isinstance(outcome, VitserveError)
        and outcome.retryable
    )


@dataclass(frozen=True, slots=True)
class Sleep:
    """What :func:`retried` yields between tries: wait ``seconds`` (and send back None)."""

    seconds: float


def retried(flow: Flow, policy: RetryPolicy) -> Generator[Op | Sleep, Any, Any]:
    """``flow`` with each op tried as ``policy`` says: the retry loop of both clients, written
    once and without I/O. It yields each try of an op (send back its outcome: the answer, or
    the :class:`~vitserve.errors.VitserveError` it raised) and a :class:`Sleep` between tries;
    it returns the flow's value, or raises the error of an op whose tries are spent (one whose
    store call falls back is handed to the flow instead, neither retried nor raised)."""
    try:
        op = next(flow)
        while True:
            op = flow.send((yield from _tries(op, policy)))
    except StopIteration as done:
        return done.value


def _tries(op: Op, policy: RetryPolicy) -> Generator[Op | Sleep, Any, Any]:
    """One op's tries (see :func:`retried`): its outcome for the flow, or its error raised."""
    for attempt in range(policy.attempts):
        outcome = yield op
        if falls_back(op, outcome):  # the core reads elsewhere: no retry, no raise
            return outcome
        delay = retry_delay(policy, attempt, outcome)
        if delay is None:
            break
        yield Sleep(delay)
    if isinstance(outcome, VitserveError):
        raise outcome
    return outcome


#: an error answer's fields that are the shape's own (OpenAI's), not the error's
OPENAI_ERROR_FIELDS = ("type", "message", "param", "code")


def error_from(reply: Reply) -> VitserveError:
    """The VitserveError an error answer describes (``{"error": {"type", "message", ...}}``):
    the class it names with its fields, else :class:`~vitserve.errors.ApiError`."""
    doc = reply.body.get("error") if isinstance(reply.body, dict) else None
    if not isinstance(doc, dict):
        return errors.ApiError(reply.status, "", f"unexpected answer: {str(reply.body)[:200]}")
    cls = getattr(errors, str(doc.get("type")), None)
    message = str(doc.get("message", ""))
    if not (isinstance(cls, type) and issubclass(cls, VitserveError)):
        return errors.ApiError(reply.status, str(doc.get("type")), message)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    for name, value in doc.items():
        if name not in OPENAI_ERROR_FIELDS:
            setattr(exc, name, value)
    return exc


def check(reply: Reply) -> Any:
    """The body of a successful answer; the error it describes otherwise."""
    if reply.status != 200:
        raise error_from(reply)
    return reply.body


def handle_of_header(header: Header, cached: bool, source: bytes | None = None) -> ImageHandle:
    return ImageHandle(
        key=header.key,
        num_tokens=header.num_tokens,
        grid=header.grid,
        dtype=header.dtype,
        shape=(header.num_tokens, header.tensors[0].width),
        cached=cached,
        extras=tuple(t.name for t in header.tensors[1:]),
        source=source,
        times=header.times,
        frame_rate=header.frame_rate,
    )


@dataclass
class ClientCore:
    """The state both clients share: the service's model description (learned once), the
    direct store (opened once that is known), the header cache of row reads, the metrics."""

    store_url: str | None = field(default=None, repr=False)  # may hold a password
    store: EmbeddingStore | None = None  # opened from store_url after healthz
    metrics: ClientMetrics = field(default_factory=ClientMetrics)
    model: dict[str, Any] | None = None
    headers: OrderedDict[str, Header] = field(default_factory=OrderedDict)

    @classmethod
    def for_client(
        cls, url: str | None, handle: object, store: EmbeddingStore | str | None, registry: Any
    ) -> ClientCore:
        """The core of a client of the service at ``url`` or behind ``handle`` (exactly one),
        reading ``store`` (a store URL, an open store, or None) directly."""
        if (url is None) == (handle is None):
            raise ConfigError("give the service's url or its ingress handle (one of them)")
        if isinstance(store, str):
            return cls(store_url=store, metrics=ClientMetrics(registry))
        return cls(store=store, metrics=ClientMetrics(registry))

    def _limit(self, name: str, default: int) -> int:
        """A request limit the service reported on ``/healthz`` (after describe)."""
        return int((self.model or {}).get("limits", {}).get(name, default))

    # -- the service's model -------------------------------------------------------------------
    def describe(self) -> Flow:
        """The service's ``/healthz`` answer (model, fingerprint, namespace, limits), asked
        once; opens the direct store under that fingerprint and namespace. With the service's
        auth on, the namespace is the caller's tenant's (the token's)."""
        if self.model is None:
            model = check((yield ApiCall("healthz")))
            if "fingerprint" not in model and model.get("auth") == "bearer":
                raise errors.AuthenticationError(
                    "missing", "the service needs a bearer token: give the client token=..."
                )
            self._open_store(model)
            self.model = model
        return self.model

    def _open_store(self, model: dict[str, Any]) -> None:
        """The direct store, checking the service's fingerprint in its namespace: opened from
        ``store_url`` (the client owns it), or a store over the connection of the store the
        caller gave (theirs to close), counting in that store's counters."""
        namespace, fingerprint = model.get("namespace") or "", model["fingerprint"]
        if self.store is None and self.store_url is not None:
            self.store = open_store(self.store_url, namespace=namespace, fingerprint=fingerprint)
        if self.store is not None and "claims_at" in model:  # a service that says where
            mine = self.store.connection.claim_scope
            if mine != model["claims_at"]:  # e.g. node:// here, the service on another node
                raise errors.StoreSplitError(str(mine), str(model["claims_at"]))
        if self.store is not None:  # and whether or not it says: the namespace and the model
            given = self.store
            if given.namespace != namespace:
                raise ConfigError(
                    f"the store's namespace {given.namespace!r} is not the service's {namespace!r}"
                )
            if given.fingerprint not in (None, fingerprint):
                raise ConfigError(
                    f"the store checks records of the model {given.fingerprint!r}, the service "
                    f"serves {fingerprint!r}"
                )
            if given.fingerprint is None:
                policy = replace(given.policy, fingerprint=fingerprint)
                self.store = EmbeddingStore(given.connection, policy, counters=given.counters)

    def keys_of(self, datas: Sequence[bytes], video_for: VideoFor = VideoFor.MODEL) -> list[str]:
        """The content keys of image or video bytes, as the service computes them (after
        describe): a video's under its sampling ``video_for``'s way
        (:func:`vitserve.keys.item_key`). A video asked a way the service does not know for a
        model that takes videos is a ConfigError (a model that takes none refuses it per item,
        as it does any video)."""
        assert self.model is not None
        fp, ns = self.model["fingerprint"], self.model.get("namespace") or ""
        video = video_settings(self.model, video_for)
        takes_video = video_settings(self.model, VideoFor.MODEL) is not None
        if video is None and takes_video and any(media_of(d) is Media.VIDEO for d in datas):
            raise ConfigError(
                f"video_for={video_for.value}: the service does not know how it samples "
                f"{self.model.get('family')} videos"
            )
        return [item_key(d, fp, ns, video) for d in datas]

    # -- encode --------------------------------------------------------------------------------
    def encode(self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL) -> Flow:
        """One :class:`ImageHandle` per image, in order: keys computed here, one probe, then
        uploads of only the images the store lacks (none when all are held). A video is
        sampled ``video_for``'s way (the model's, or vLLM's: :class:`~vitserve.media.VideoFor`)."""
        if not images:
            raise ConfigError("encode needs at least one image")
        datas = [image_bytes(image, i) for i, image in enumerate(images)]
        yield from self.describe()
        keys = self.keys_of(datas, video_for)
        data_of = dict(zip(keys, datas, strict=True))
        distinct = list(data_of)
        # an image whose publish is under way (its claim held: an encode answered, or another
        # caller's in flight) is waited for, not sent again
        held = yield from self.probe(distinct, wait=True)
        handles = {k: h for k, h in zip(distinct, held, strict=True) if h is not None}
        missing = [k for k in distinct if k not in handles]
        self.metrics.inc("probes", len(distinct))
        self.metrics.inc("hits", len(handles))
        self.metrics.inc("bytes_skipped", sum(len(data_of[k]) for k in handles))
        first_index: dict[str, int] = {}
        for i, k in enumerate(keys):
            first_index.setdefault(k, i)
        uploaded = yield from self._upload(
            missing, data_of, first_index, EncodeWait.PUBLISHED, video_for
        )
        for key, handle in uploaded.items():
            if handle is None:  # a service that answered before its publish, unasked
                raise errors.ApiError(502, "pending", f"image {key[:12]}... answered unpublished")
            handles[key] = handle
        return [
            replace(handles[k], source=handles[k].source or d, video_for=video_for)
            for k, d in zip(keys, datas, strict=True)
        ]

    def submit(self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL) -> Flow:
        """One :class:`Submitted` per image, in order: as :meth:`encode` (keys here, one probe,
        uploads of only what the store lacks), but the service answers once the new images are
        claimed (``EncodeWait.CLAIMED``): a new image is pending, its record published after
        the answer. Refused images raise as in :meth:`encode`."""
        if not images:
            raise ConfigError("submit needs at least one image")
        datas = [image_bytes(image, i) for i, image in enumerate(images)]
        yield from self.describe()
        keys = self.keys_of(datas, video_for)
        data_of = dict(zip(keys, datas, strict=True))
        distinct = list(data_of)
        held = yield from self.probe(distinct)
        found = {k: h for k, h in zip(distinct, held, strict=True) if h is not None}
        missing = [k for k in distinct if k not in found]
        self.metrics.inc("probes", len(distinct))
        self.metrics.inc("hits", len(found))
        self.metrics.inc("bytes_skipped", sum(len(data_of[k]) for k in found))
        first_index: dict[str, int] = {}
        for i, k in enumerate(keys):
            first_index.setdefault(k, i)
        sent = yield from self._upload(missing, data_of, first_index, EncodeWait.CLAIMED, video_for)
        return [
            Submitted(k, found[k], False) if k in found else Submitted(k, sent[k], True)
            for k in keys
        ]

    def probe(self, keys: Sequence[str], wait: bool = False) -> Flow:
        """Per key, the handle of the embedding the store holds (``cached``), else None: one
        direct store read (its headers; with ``wait``, a key whose claim someone holds is
        waited for, as the store's record reads do), or ``/v1/probe`` batches without a store
        or while it is down."""
        if not keys:
            return []
        yield from self.describe()
        if self.store is not None:
            found = yield StoreCall("headers_many", (list(keys), wait), fallback=True)
            if not isinstance(found, VitserveError):  # else it is down (falls_back): ask the API
                self.headers.update((h.key, h) for h in found if h is not None)  # for row reads
                return [None if h is None else handle_of_header(h, cached=True) for h in found]
        out: list[ImageHandle | None] = []
        step = self._limit("max_keys_per_probe", 1024)
        for i in range(0, len(keys), step):
            body = check(
                (yield ApiCall("probe", {"keys": list(keys[i : i + step]), "headers": True}))
            )
            out += [None if item is None else ImageHandle.from_item(item) for item in body["items"]]
        return out

    def _upload(
        self,
        keys: list[str],
        data_of: dict[str, bytes],
        index_of: dict[str, int],
        wait: EncodeWait,
        video_for: VideoFor = VideoFor.MODEL,
    ) -> Flow:
        """Encode the images of ``keys`` (videos sampled ``video_for``'s way) in requests
        within the service's limits, answered as ``wait`` says; their handles by key (None:
        pending, ``EncodeWait.CLAIMED``). A refused image raises its error, with the caller's
        index."""
        max_images = self._limit("max_images_per_request", 64)
        max_bytes = self._limit("max_request_bytes", 2**62)
        out: dict[str, ImageHandle | None] = {}
        max_videos = self._limit("max_videos_per_request", 2**62)
        for batch in _batches(keys, data_of, max_images, max_bytes, max_videos):
            # the service answers a request's images, then its videos: send them so
            batch.sort(key=lambda k: media_of(data_of[k]) is Media.VIDEO)
            payload: dict[str, Any] = {
                field: [data_of[k] for k in batch if media_of(data_of[k]) is kind]
                for field, kind in (("images", Media.IMAGE), ("videos", Media.VIDEO))
            }
            if wait is not EncodeWait.PUBLISHED:
                payload["wait"] = wait.value
            if video_for is not VideoFor.MODEL:
                payload["video_for"] = video_for.value
            try:
                body = check((yield ApiCall("encode", payload)))
            except errors.ImageError as exc:  # the request refused for one of its images
                index = getattr(exc, "index", None)
                if (
                    isinstance(index, int)
                    and 0 <= index < len(batch)
                    and index_of[batch[index]] >= 0
                ):
                    exc.index = index_of[batch[index]]  # the caller's position
                    exc.args = (f"image {exc.index}: {getattr(exc, 'reason', exc)}",)
                raise
            self.metrics.inc("uploads", len(batch))
            self.metrics.inc("bytes_uploaded", sum(len(data_of[k]) for k in batch))
            for key, item in zip(batch, body["items"], strict=True):
                if "error" in item:
                    raise _item_error(item["error"], index_of[key])
                if item.get("pending"):
                    out[key] = None
                else:
                    out[key] = ImageHandle.from_item(item, source=data_of[key], uploaded=True)
        return out

    # -- fetch ---------------------------------------------------------------------------------
    def fetch_chunk(
        self,
        handles: Sequence[ImageHandle],
        offsets: Sequence[int | Sequence[int]],
        start: int,
        end: int,
    ) -> Flow:
        """The rows prefill chunk ``[start, end)`` needs (see :mod:`vitserve.client.chunks`),
        in one batched store read (two when a header is not cached yet)."""
        pieces = plan_chunk(item_spans(handles, offsets), start, end)
        reads = [(handles[p.image].key, p.row_start, p.row_end) for p in pieces]
        records = yield from self.read_rows(reads, [handles[p.image] for p in pieces])
        return FetchedChunk(
            start, end, pieces, [r.embedding for r in records], [r.extras for r in records]
        )

    def fetch(self, handles: Sequence[ImageHandle]) -> Flow:
        """Each image's whole record (embedding and extras), in order."""
        return (
            yield from self.read_rows([(h.key, 0, h.num_tokens) for h in handles], list(handles))
        )

    def read_rows(self, reads: list[tuple[str, int, int]], handles: list[ImageHandle]) -> Flow:
        """The checked rows of each read (the direct store's, else the service's: ``_read``);
        entries gone from both are encoded again from their handles' images (one upload for
        all) and read again, else CacheMissError names them all. Counted in the fetch metrics
        (rows, bytes, latency)."""
        if not reads:
            return []
        started = time.perf_counter()
        records = yield from self._read(reads)
        gone = {reads[i][0]: handles[i] for i, r in enumerate(records) if r is None}
        if gone:
            lost = [k for k, h in gone.items() if h.source is None]
            if lost:
                raise CacheMissError(lost)
            data_of = {k: h.source for k, h in gone.items()}
            index_of = dict.fromkeys(gone, -1)
            redone: dict[str, ImageHandle | None] = {}
            for way in dict.fromkeys(h.video_for for h in gone.values()):  # as each was keyed
                again_keys = [k for k, h in gone.items() if h.video_for is way]
                redone |= yield from self._upload(
                    again_keys,
                    data_of,  # type: ignore[arg-type]
                    index_of,
                    EncodeWait.PUBLISHED,
                    way,
                )
            self.metrics.inc("reencoded", len(gone))
            again = [i for i, r in enumerate(records) if r is None]
            for i, record in zip(
                again, (yield from self._read([reads[i] for i in again])), strict=True
            ):
                records[i] = record
            still = list(dict.fromkeys(reads[i][0] for i, r in enumerate(records) if r is None))
            unstored = [k for k in still if (h := redone.get(k)) is not None and not h.published]
            if unstored:  # the service said so: its store failed, nothing was evicted
                raise StoreUnavailableError(
                    "of the service",
                    f"{len(unstored)} image(s) encoded again but not stored "
                    f"({', '.join(k[:16] for k in unstored[:4])}): try again",
                )
            if still:
                raise CacheMissError(still)
        self.metrics.fetched(
            time.perf_counter() - started,
            sum(r1 - r0 for _, r0, r1 in reads),
            sum(r.nbytes for r in records),
        )
        return records

    def _read(self, reads: list[tuple[str, int, int]]) -> Flow:
        """One batched read of the rows: the direct store's ``get_rows_many`` (with the header
        cache), else the ``rows`` API route (``POST /v1/rows``: one store read for them all).
        What the direct store cannot serve (it is down, or lacks the entry) is read through
        the service in one more call, counted in ``read_fallbacks``."""
        yield from self.describe()
        if self.store is None:
            return (yield from self._read_service(reads))
        records = yield StoreCall("get_rows_many", (reads, self.headers), fallback=True)
        if isinstance(records, VitserveError):  # the store is down (falls_back)
            records = [None] * len(reads)
        while len(self.headers) > HEADER_CACHE_SIZE:
            self.headers.popitem(last=False)
        missed = [i for i, r in enumerate(records) if r is None]
        if missed:
            self.metrics.inc("read_fallbacks", len(missed))
            served = yield from self._read_service([reads[i] for i in missed])
            for i, record in zip(missed, served, strict=True):
                records[i] = record
        return records

    def _read_service(self, reads: list[tuple[str, int, int]]) -> Flow:
        """The rows through the service (``POST /v1/rows``), in calls it accepts: at most
        ``max_keys_per_probe`` reads and ``max_rows_bytes`` of rows each (at the model's
        ``row_bytes``); a read larger than that alone is read in row pieces and joined."""
        assert self.model is not None
        cap = self._limit("max_rows_bytes", 0)  # 0: a service that sets none
        row_bytes = int(self.model.get("row_bytes", 0))
        pieces = row_pieces(reads, cap // max(1, row_bytes))
        replies: list[Reply] = []
        for batch in piece_batches(pieces, self._limit("max_keys_per_probe", 1024), cap, row_bytes):
            answer = yield ApiCall("rows", batch)
            replies += answer if isinstance(answer, list) else [check(answer)]  # (check raises)
        parts: list[list[EmbeddingRecord | None]] = [[] for _ in reads]
        for (n, (key, r0, _)), reply in zip(pieces, replies, strict=True):
            if reply.status == 404:
                parts[n].append(None)
                continue
            record = decode_record(check(reply), key=key, fingerprint=self.model["fingerprint"])
            parts[n].append(replace(record, row_start=r0))  # the rows' record as a partial one
        return [join_rows(p) for p in parts]


def row_pieces(
    reads: list[tuple[str, int, int]], max_rows: int
) -> list[tuple[int, tuple[str, int, int]]]:
    """Each read as ``(its index, read)`` pieces of at most ``max_rows`` rows (0: whole)."""
    out = []
    for n, (key, r0, r1) in enumerate(reads):
        step = max_rows if max_rows > 0 else r1 - r0
        out += [(n, (key, a, min(r1, a + step))) for a in range(r0, r1, max(step, 1))]
    return out


def piece_batches(
    pieces: list[tuple[int, tuple[str, int, int]]], max_reads: int, max_bytes: int, row_bytes: int
) -> list[list[tuple[str, int, int]]]:
    """Consecutive pieces in batches of at most ``max_reads`` reads and ``max_bytes`` of rows
    (0: no byte cap)."""
    batches: list[list[tuple[str, int, int]]] = []
    size = 0
    for _, read in pieces:
        nbytes = (read[2] - read[1]) * row_bytes
        if (
            not batches
            or len(batches[-1]) >= max_reads
            or (max_bytes and size + nbytes > max_bytes)
        ):
            batches.append([])
            size = 0
        batches[-1].append(read)
        size += nbytes
    return batches


def join_rows(parts: list[EmbeddingRecord | None]) -> EmbeddingRecord | None:
    """The record of one read from its pieces' records, in row order (None if any is gone)."""
    if any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    import numpy as np  # only for a read split in pieces

    first = parts[0]
    assert first is not None
    tensors = {
        name: np.concatenate([p.tensors[name] for p in parts if p is not None])
        for name in first.tensors
    }
    return replace(first, tensors=tensors)


def _item_error(doc: dict[str, Any], index: int) -> VitserveError:
    exc = error_from(Reply(int(doc.get("status", 422)), {"error": doc}))
    if hasattr(exc, "index") and index >= 0:
        exc.index = index  # the caller's position, not the upload request's
        exc.args = (f"image {index}: {getattr(exc, 'reason', exc)}",)
    return exc


def _batches(
    keys: list[str],
    data_of: dict[str, bytes],
    max_images: int,
    max_bytes: int,
    max_videos: int = 2**62,
) -> list[list[str]]:
    """Keys in upload requests of at most ``max_images`` items (``max_videos`` of them videos)
    and ``max_bytes`` bytes (an item over the byte limit alone goes alone: the service says why
    it refuses it)."""
    out: list[list[str]] = []
    size = videos = 0
    for key in keys:
        n = len(data_of[key])
        video = media_of(data_of[key]) is Media.VIDEO
        full = len(out[-1]) >= max_images or size + n > max_bytes if out else True
        if full or (video and videos >= max_videos):
            out.append([])
            size = videos = 0
        out[-1].append(key)
        size += n
        videos += video
    return out


__all__ = [
    "ApiCall",
    "ClientCore",
    "Flow",
    "Reply",
    "RetryPolicy",
    "StoreCall",
    "check",
    "error_from",
    "falls_back",
    "retry_after_seconds",
    "retry_delay",
]
