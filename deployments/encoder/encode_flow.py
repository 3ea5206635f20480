"""What the ingress does with one encode request, once its HTTP body is read and checked.

Per request, never per image:

1. **One store round trip**: ``lookup_or_claim`` of every distinct key. Held keys are answered
   from their headers (``cached: true``); each new image is claimed for this request's token
   (or found claimed by someone else). An all-cached request ends here: no encoder call. A
   new image that another request on this ingress is encoding is joined here (single flight,
   ``vitserve.deployments.encoder.single_flight``): it does not travel to the encoder again.
2. **One encoder call** with all the request's new images (an :class:`EncodeBatch`), plus one
   preprocess call first when ``preprocess_at`` is ``deployment`` (its answer goes to the
   encoder by reference; the pixels never pass through the ingress). With ``ingress`` the
   images are preprocessed here, in a worker thread.
3. The encoder publishes each embedding and releases its claim in one store call.

The same image twice in a request is encoded once. A full encoder queue, or an encoder replica
whose admitted work leaves no room for the request's (``vitserve.deployments.encoder.admission``),
raises :class:`~vitserve.errors.BackpressureError` (the API's 429), an encoder (or preprocess)
replica that died or is restarting :class:`~vitserve.errors.ServiceUnavailableError` (503,
retryable); either way the request's claims are released. A store that fails the lookup
does not fail the request: its images are encoded unclaimed (``ClaimState.UNCLAIMED``; single
flight then holds within a replica only).

Once its images are claimed, a request's flow runs to its end even if its caller goes away (the
client disconnected): its claims are then published or released, never left to their ttl, and
the encoder's admission counts its work until it ends.

``wait=claimed`` (:class:`~vitserve.client.handles.EncodeWait`; the vLLM front's overlap)
answers once step 1 is done: held images as usual, each new image that step 1 claimed (for this
request or found claimed by another) as a :class:`~vitserve.deployments.encoder.wire.PendingItem`;
steps 2 and 3 then run on, as for a caller gone away, and a failure there is logged and counted
(``vitserve_background_encode_failures_total``), its claims released: a reader waiting on them
reads a miss, never a wrong row. A request whose lookup failed (its images unclaimed: no reader
could see them coming) or that ends before any claim (all held, refused) answers as with
``published``.

Namespaces: a request is served by one store, its namespace's (with auth on, the caller's
tenant's store over the ingress's store connection; see ``vitserve.deployments.common.auth``).
Its lookups, claims and releases go there, and the encoder call names that namespace, so the
encoder claims, waits and publishes in it too: a key of another namespace is never found,
claimed or written.

The class is plain Python over a store and two Serve-handle-like objects (``.method.remote()``
returning an awaitable: :class:`EncoderHandle`, :class:`PreprocessHandle`), so tests can drive it
with counting stand-ins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar

from ray.serve.exceptions import BackPressureError

from vitserve.cache.base import Claim, EmbeddingStore
from vitserve.cache.codec import Header
from vitserve.client.handles import EncodeWait
from vitserve.deployments.common import metrics
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.encoder.flight_store import FlightStore
from vitserve.deployments.encoder.preprocessing import ImagePreparer, prepare_all
from vitserve.deployments.encoder.routing import THIS_CALLER
from vitserve.deployments.encoder.single_flight import ClaimState, Role, SingleFlight
from vitserve.deployments.encoder.wire import (
    AnswerItem,
    ClaimsAt,
    EncodeBatch,
    EncodedItem,
    ErrorItem,
    describe_header,
    error_item,
    is_error,
    pending_item,
    with_cached,
)
from vitserve.encoder.work import Terms
from vitserve.errors import (
    BackpressureError,
    CacheMissError,
    ServiceUnavailableError,
    StoreError,
    VitserveError,
    actor_unavailable_errors,
)
from vitserve.media import VideoFor

log = logging.getLogger("ray.serve")

T_co = TypeVar("T_co", covariant=True)


class RemoteMethod(Protocol[T_co]):
    """A method of a Serve handle: ``.remote(...)`` answers a response, awaited for its result
    or passed as an argument of another call (by reference: its result does not travel here)."""

    def remote(self, *args: Any) -> Awaitable[T_co]: ...


class EncoderHandle(Protocol):
    """The encoder deployment's handle, as the flow and the ingress call it
    (``EncoderDeployment``'s ``encode``, ``describe``, ``work_terms``, ``counters``)."""

    @property
    def encode(self) -> RemoteMethod[list[EncodedItem | ErrorItem]]: ...
    @property
    def describe(self) -> RemoteMethod[dict[str, Any]]: ...
    @property
    def work_terms(self) -> RemoteMethod[Terms]: ...
    @property
    def counters(self) -> RemoteMethod[dict[str, Any]]: ...


class PreprocessHandle(Protocol):
    """The preprocess deployment's handle (``PreprocessDeployment.prepare``)."""

    @property
    def prepare(self) -> RemoteMethod[list[Any]]: ...


def backpressure(exc: Exception) -> BackpressureError | None:
    """Serve's full-queue error as vitserve's, or None for other errors."""
    if isinstance(exc, BackPressureError):  # args: num_queued_requests, max_queued_requests
        return BackpressureError(queued=exc.args[0], limit=exc.args[1])
    return None


def raised_remotely(exc: Exception) -> VitserveError | None:
    """The vitserve error a replica raised (Ray hands it over wrapped: a ``RayTaskError`` whose
    message is the remote traceback), or None for other errors."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, VitserveError):
        return cause
    return None


def unavailable(exc: Exception) -> ServiceUnavailableError | None:
    """A dead or restarting encoder replica (Ray's actor errors, Serve's unavailable
    deployment), or a preprocess replica that died while the encoder call waited for its
    answer (Serve raises its own error then, caused by Ray's), as a retryable 503, or None
    for other errors."""
    dead = actor_unavailable_errors()
    if isinstance(exc, dead):
        return ServiceUnavailableError("encoder", f"{type(exc).__name__}: {exc}"[:300])
    if isinstance(exc.__cause__, dead):  # the replica computing an argument of the call died
        return ServiceUnavailableError(
            "encoder", f"{type(exc.__cause__).__name__} upstream: {exc.__cause__}"[:300]
        )
    return None


class EncodeFlow:
    """One encode request -> one answer item per input item, in order (see the module)."""

    def __init__(
        self,
        cfg: VitserveConfig,
        store: EmbeddingStore | None,
        encoder: EncoderHandle,
        preprocess: PreprocessHandle | None = None,
        preprocessor: ImagePreparer | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store  # None: every request names its own
        self.encoder = encoder
        self.preprocess = preprocess  # the preprocess deployment's handle (``deployment``)
        self.preprocessor = preprocessor  # a Preprocessor (``ingress``)
        # this ingress's flights, and the claims it releases
        self.flights = SingleFlight(hook=metrics.flight_hook("ingress"))
        self.flight_store = FlightStore(self.flights)
        # wait=claimed requests' flows, running on after their answers (held until they end)
        self.background: set[asyncio.Task[Any]] = set()

    async def encode(
        self,
        items: list[bytes | str],
        keys: list[str],
        store: EmbeddingStore | None = None,
        patches: Sequence[int] | None = None,
        wait: EncodeWait = EncodeWait.PUBLISHED,
        video_for: VideoFor = VideoFor.MODEL,
    ) -> list[AnswerItem]:
        """``items``: image bytes, or a key the caller believes held; ``keys`` their keys (in
        ``store``'s namespace; ``store`` None: this flow's store, the config's namespace);
        ``patches`` each item's work (the encoder router's hint; None: unknown, 0); ``wait``
        when to answer (module); ``video_for`` whose sampling the videos are encoded by (their
        ``keys`` are under it). Runs as a task of its own: cancelling the caller leaves it to
        finish (module)."""
        if wait is EncodeWait.PUBLISHED:
            work = asyncio.create_task(
                self._encode(items, keys, store, patches, video_for=video_for)
            )
            return list(await asyncio.shield(work))
        claimed: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        work = asyncio.create_task(self._encode(items, keys, store, patches, claimed, video_for))
        self.background.add(work)
        work.add_done_callback(self._background_ended)
        waits: set[asyncio.Future[Any]] = {claimed, work}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not claimed.done() or any(
            state is None for state in claimed.result().values()
        ):  # ended before any claim, or unclaimed (the store failed): the whole answer
            return list(await asyncio.shield(work))
        return self._claimed_answer(keys, items, claimed.result())

    @staticmethod
    def _claimed_answer(
        keys: list[str], items: list[bytes | str], answer_of: dict[str, Any]
    ) -> list[AnswerItem]:
        """The answer once the new images are claimed: held ones described, new ones pending,
        a key-only item the store lacks a miss (as the whole answer gives them)."""
        out: list[AnswerItem] = []
        for key, item in zip(keys, items, strict=True):
            state = answer_of[key]
            if state is not None and not isinstance(state, Claim):
                out.append(with_cached(describe_header(state), True))
            elif isinstance(item, str):
                out.append(error_item(CacheMissError([key])))
            else:
                out.append(pending_item(key))
        return out

    def _background_ended(self, work: asyncio.Task[Any]) -> None:
        """A ``wait=claimed`` request's flow ended after its answer: a failure is logged and
        counted (its claims were released where it failed)."""
        self.background.discard(work)
        if work.cancelled():
            return
        exc = work.exception()
        failed = exc is not None or any(is_error(item) for item in work.result())
        if failed:
            metrics.inc("background_encode_failures_total")
            log.warning(
                "an encode answered at its claims failed after: %s",
                f"{type(exc).__name__}: {exc}" if exc is not None else "an image's error",
            )

    async def _encode(
        self,
        items: list[bytes | str],
        keys: list[str],
        store: EmbeddingStore | None = None,
        patches: Sequence[int] | None = None,
        claimed: asyncio.Future[dict[str, Any]] | None = None,
        video_for: VideoFor = VideoFor.MODEL,
    ) -> list[EncodedItem | ErrorItem]:
        store = self.store if store is None else store
        assert store is not None, "a flow without a store of its own is given each request's"
        distinct = list(dict.fromkeys(keys))
        # One token per request: releasing this request's claims (after a failed encoder call)
        # can never drop a later request's claim on the same key.
        token = uuid.uuid4().hex
        answers = await self._lookup_or_claim(store, distinct, token)
        answer_of = dict(zip(distinct, answers, strict=True))
        if claimed is not None and not claimed.done():  # wait=claimed: its answer can go now
            claimed.set_result(answer_of)
        data_of = {k: i for k, i in zip(keys, items, strict=True) if isinstance(i, bytes)}
        patches_of = dict(zip(keys, patches or [0] * len(keys), strict=True))
        index_of: dict[str, int] = {}
        for i, key in enumerate(keys):
            index_of.setdefault(key, i)

        results: dict[str, EncodedItem | ErrorItem] = {}
        new: list[str] = []
        states: list[ClaimState] = []  # each new key's
        unneeded: list[tuple[str, str]] = []  # claims on keys nobody sent pixels for
        for key, answer in answer_of.items():
            if answer is not None and not isinstance(answer, Claim):  # a header: held
                results[key] = with_cached(describe_header(answer), True)
                metrics.inc("cache_hits_total")
            elif key not in data_of:
                results[key] = error_item(CacheMissError([key]))
                metrics.inc("cache_misses_total")
                if answer is Claim.WON:
                    unneeded.append((key, token))
            else:
                new.append(key)
                states.append(ClaimState.of(answer))
                metrics.inc("cache_misses_total")
        if new:
            await self._encode_new(
                new,
                states,
                data_of,
                index_of,
                patches_of,
                token,
                store,
                results,
                unneeded,
                video_for,
            )
        else:
            self.flight_store.release_later(store, unneeded)
        return [results[k].copy() for k in keys]

    async def _encode_new(
        self,
        new: list[str],
        states: list[ClaimState],
        data_of: dict[str, bytes],
        index_of: dict[str, int],
        patches_of: dict[str, int],
        token: str,
        store: EmbeddingStore,
        results: dict[str, EncodedItem | ErrorItem],
        releases: list[tuple[str, str]],
        video_for: VideoFor = VideoFor.MODEL,
    ) -> None:
        """The request's new images: each one a request on this ingress is encoding already
        is joined here (single flight from the moment of the claim, before any preprocessing);
        the others go to the encoder in one call, and the flights they lead here end with it."""
        plan = self.flights.plan(new, states, token)
        self.flight_store.release_later(store, [*releases, *plan.releases])
        send = [i for i, r in enumerate(plan.roles) if r is not Role.JOIN]
        try:
            if send:
                batch = EncodeBatch(
                    keys=[new[i] for i in send],
                    indices=[index_of[new[i]] for i in send],
                    claims=[states[i] for i in send],
                    token=token,
                    images=[data_of[new[i]] for i in send],
                    namespace=store.namespace,
                    claims_at=ClaimsAt(store.connection.claim_scope),
                    patches=[patches_of[new[i]] for i in send],
                    caller=THIS_CALLER,
                    video_for=video_for,
                )
                answers = await self._call_encoder(batch, store)
                for i, answer in zip(send, answers, strict=True):
                    if i in plan.futures:
                        self.flights.settle(plan.futures[i], answer)
                    results[new[i]] = with_cached(answer, False)
        except BaseException as exc:
            self.flights.end(plan, exc)  # joiners of this request's images fail as it did
            raise
        for i in plan.indices(Role.JOIN):
            answer = await self.flights.join(plan.futures[i])
            results[new[i]] = with_cached(answer, False)

    async def _lookup_or_claim(
        self, store: EmbeddingStore, keys: list[str], token: str
    ) -> Sequence[Header | Claim | None]:
        """Per key its header, ``Claim.WON`` / ``Claim.BUSY``, or None (the store failed)."""
        ttl = self.cfg.single_flight.claim_ttl_s
        try:
            with metrics.timed("store_round_trip_seconds", op="lookup_or_claim"):
                return await asyncio.to_thread(store.lookup_or_claim, keys, ttl, token)
        except StoreError as exc:  # encode anyway, unclaimed; the encoder publishes if it can
            metrics.inc("store_errors_total", op="lookup_or_claim")
            log.warning("store lookup failed: %s", exc)
            return [None] * len(keys)

    async def _call_encoder(
        self, batch: EncodeBatch, store: EmbeddingStore
    ) -> list[EncodedItem | ErrorItem]:
        where = self.cfg.preprocess_at
        try:
            if where == "encoder":
                return await self.encoder.encode.remote(batch)
            prepared: Awaitable[list[Any]] | list[Any]
            if where == "deployment":  # the pixels go by reference; the bytes need not travel
                assert self.preprocess is not None, "preprocess_at: deployment has its handle"
                prepared = self.preprocess.prepare.remote(batch)
            else:
                assert self.preprocessor is not None, "preprocess_at: ingress has a preprocessor"
                assert batch.images is not None, "the flow sends the bytes it was given"
                prepared = await asyncio.to_thread(
                    prepare_all,
                    self.preprocessor,
                    batch.images,
                    batch.keys,
                    batch.indices,
                    batch.video_for,
                )
            return await self.encoder.encode.remote(
                dataclasses.replace(batch, images=None), prepared
            )
        except Exception as exc:
            # nobody will publish them: let waiters go now, not at the claim's ttl
            self.flight_store.release_later(
                store,
                [
                    (k, batch.token)
                    for k, c in zip(batch.keys, batch.claims, strict=True)
                    if c is ClaimState.WON
                ],
            )
            err = backpressure(exc) or unavailable(exc) or raised_remotely(exc)
            if err is not None:
                raise err from None
            raise


__all__ = [
    "EncodeFlow",
    "EncoderHandle",
    "PreprocessHandle",
    "RemoteMethod",
    "backpressure",
    "raised_remotely",
    "unavailable",
]
