"""The encoder deployment (the preprocess replicas are in
:mod:`~vitserve.deployments.encoder.preprocessing`, what both exchange with the ingress in
:mod:`~vitserve.deployments.encoder.wire`).

``EncoderDeployment`` (one replica per GPU, or CPU) holds an :class:`EncoderEngine`. It takes
**one call per request**: ``encode(batch, prepared)`` with all of the request's images that the
ingress found missing (:class:`EncodeBatch`) and answers with their results in order.

* Preprocessing runs where the config's ``preprocess_at`` says: in this replica's CPU threads
  (the images arrive as bytes), in the ingress, or in ``PreprocessDeployment`` (CPU replicas
  that scale apart; its answer reaches this replica by reference through the object store).
  A bad image fails alone: its item carries the error.
* Batching is :class:`~vitserve.deployments.encoder.device_queue.DeviceQueue`, the one queue between
  callers and the device (its docstring states the rule), so concurrent requests share forwards.
* Admission (:class:`~vitserve.deployments.encoder.admission.WorkBudget`): a request's new
  images are admitted by their patches and bytes, read from their headers before any pixel is
  decoded, or the request is refused at once (429; 413 if it could never fit).
* Single flight (:class:`~vitserve.deployments.encoder.single_flight.SingleFlight`, which states the
  rule): a won image is encoded and published with its claim released in the same store call;
  an image already being encoded on this replica (from the moment its request arrived) is
  joined; a busy one is awaited on the store without holding a thread, and encoded here only if
  its claimant gave up. Store failures never fail an encode (they are counted).
* So a new image costs two store round trips (the ingress's lookup-or-claim and the publish),
  and this replica makes none before its forward; a claimed image's answer does not wait for
  its publish (readers wait on the claim instead: ``_encode_and_publish``), so its path holds
  one.
* Namespaces (tenants, see ``vitserve.deployments.common.auth``): each batch names the namespace its
  images are keyed in; claims, waits and the publish go to that namespace's store over this
  replica's one store connection (a device step that mixes namespaces publishes once per
  namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray import serve

from vitserve.cache import open_connection
from vitserve.cache.base import EmbeddingStore
from vitserve.cache.codec import encode_record, read_header
from vitserve.cache.views import StoreViews
from vitserve.deployments.common import metrics
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.encoder import autoscaling, routing
from vitserve.deployments.encoder.admission import Ticket, WorkBudget, image_work
from vitserve.deployments.encoder.device_queue import DeviceQueue, Work
from vitserve.deployments.encoder.preprocessing import make_preprocessor, prepare_all
from vitserve.deployments.encoder.records import embedding_record
from vitserve.deployments.encoder.single_flight import ClaimState, Role, SingleFlight
from vitserve.deployments.encoder.wire import (
    CLAIMS_UNSTATED,
    EncodeBatch,
    EncodedItem,
    ErrorItem,
    describe_header,
    error_item,
    is_error,
    unpublished,
)
from vitserve.encoder.device import available_cpus, dtype_name
from vitserve.encoder.engine import EncoderEngine
from vitserve.encoder.work import ImageWork, Terms
from vitserve.errors import (
    ConfigError,
    StoreError,
    StoreSplitError,
    StoreUnavailableError,
    VitserveError,
)
from vitserve.media import VideoFor

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

# A publish the store refused as unavailable (a primary failing over, a restart) is tried again
# after each of these waits, on a thread of its own (off the answers' path, the device loop's and
# the first publishes'), its claims held meanwhile so that readers wait for the record instead of
# missing it: a store back within a few seconds loses nothing that was answered. Then it is given
# up (logged, claims released), as is one refused while MAX_REPUBLISHING others are being tried
# again (a long outage holds no more embeddings than that).
PUBLISH_RETRY_S = (0.5, 1.0, 2.0)
MAX_REPUBLISHING = 32


@dataclass(frozen=True, slots=True)
class Publish:
    """Where a queued image's embedding goes (the device queue carries it opaquely): the store
    of its namespace, and the claim its publish releases (``(key, token)``) or None."""

    store: EmbeddingStore
    release: tuple[str, str] | None


def _release_on_done(ticket: Ticket, i: int, _: asyncio.Future) -> None:
    """A queued image's done callback: its admitted work is given back."""
    ticket.release(i)


def replica_device(configured: str | None, gpu_ids: list[Any]) -> str:
    """The device an encoder replica runs on: a GPU only where Ray reserved one for it
    (``gpu_ids``: ``ray.get_gpu_ids()``; Ray no longer hides the GPUs from an actor that asked
    for none, so ``torch.cuda.is_available()`` says nothing about which are its). ``None``:
    cuda with a reserved GPU, else cpu; cuda without one is refused, naming why."""
    if configured is None:
        return "cuda" if gpu_ids else "cpu"
    if configured.startswith("cuda") and not gpu_ids:
        raise ConfigError(
            f"device {configured!r} but Ray reserved no GPU for this encoder replica "
            "(encoder.num_gpus is 0): it would share an unreserved cuda:0"
        )
    return configured


@serve.deployment
class EncoderDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        cfg = VitserveConfig.model_validate(config)
        # a GPU only where Ray reserved one for this replica (see replica_device)
        device = replica_device(cfg.device, ray.get_gpu_ids())
        cfg = cfg.model_copy(update={"device": device})
        self.cfg = cfg
        cuda = device.startswith("cuda")
        threads = cfg.torch_threads or (None if cuda else available_cpus())
        if threads:
            torch.set_num_threads(threads)
        # Forwards run one at a time on one thread of their own. OpenMP's thread count is per
        # thread, and a new thread starts from OMP_NUM_THREADS, which Ray sets to the replica's
        # num_cpus (1): oneDNN's bf16 kernels then ran on one core while aten's ran on all
        # (448px forwards ~20% slower than in-process). The device thread sets it first.
        # This thread sets it too and loads the engine, so the process holds two OpenMP teams,
        # more threads than a 2-core replica has cores: libgomp then cuts its idle threads'
        # spin short. Tried on a 2-vCPU Xeon (2026-11-27): loading on the device thread alone
        # (one team, full spin) made a lone 448px forward ~1 ms faster, left a sequential
        # request's HTTP p50 unchanged, and cut four closed-loop clients' throughput from
        # ~28 to ~21.5 requests/s: the spinning thread took the cores preprocessing needed.
        init: dict[str, Any] = (
            {"initializer": torch.set_num_threads, "initargs": (threads,)} if threads else {}
        )
        self._device_pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-device", **init)
        # Preprocessing (preprocess_at: encoder) on the cores the container may use, beside
        # the forwards.
        self._cpu_pool: ThreadPoolExecutor | None = None
        if cfg.preprocess_at == "encoder":
            self._cpu_pool = ThreadPoolExecutor(
                available_cpus(), thread_name_prefix="vitserve-preprocess"
            )
        self.engine = EncoderEngine.from_pretrained(
            cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            budget_bytes=cfg.budget_bytes,
            max_batch_patches=cfg.batching.max_batch_patches,
            revision=cfg.revision,
            namespace=cfg.namespace,
            limits=cfg.limits.image_limits(),
            video_limits=cfg.limits.video_limits(),
        )
        self.preprocessor = make_preprocessor(cfg, self.engine.adapter)  # no load: the engine's
        # One connection for every namespace, one store over it per namespace (the config's,
        # and with auth on each tenant's), all checking the engine's fingerprint and counting
        # together (the replica's store gauges).
        connection, policy = open_connection(cfg.store, fingerprint=self.engine.fingerprint)
        self._views = StoreViews(connection, policy, owns_connection=True)
        self.store = self._views.get(cfg.namespace)
        # One cap for the queue's steps and the engine's forwards (config, else the engine's).
        self.queue = DeviceQueue(
            self._encode_and_publish,
            max_batch_patches=self.engine.max_batch_patches,
            wait_s=cfg.batching.batch_wait_timeout_s,
            enabled=cfg.batching.enabled,
        )
        # What this replica admits (from the activation budget unless configured), and how an
        # image's cost is read from its header (the ingress gets the same terms: ``terms``).
        self.terms = self.engine.terms(
            max_image_pixels=cfg.limits.max_image_pixels,
            max_patches=cfg.admission.max_patches,
            max_bytes=cfg.admission.max_bytes,
        )
        self.budget = WorkBudget(self.terms.capacity)
        self.flights = SingleFlight(hook=metrics.flight_hook("encoder"))
        # Publishes have a thread of their own: nothing else (single flight's polls, a slow
        # store call) can hold up the device loop's publish.
        self._publish_pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-publish")
        self._republish_pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-republish")
        # The latest step's publish (``_encode_and_publish``): each step waits for the one before
        # it, so only this one can still run past its answers. Its puts, as the publish thread's
        # futures, for ``__del__``.
        self._last_publish: asyncio.Future | None = None
        self._last_puts: list[Future] = []
        self._republishing: set[asyncio.Task] = set()  # PUBLISH_RETRY_S's, under way
        self._forwards: deque[dict[str, Any]] = deque(maxlen=256)  # the latest forwards
        self._seconds: defaultdict[str, float] = defaultdict(float)  # device-step time by phase
        self._store_reporter: asyncio.Task | None = None
        self._evictions = metrics.RunningCount()  # the store's count, as increments
        self._stopping = False  # set when Serve stops the replica (``__del__``)
        # Autoscaling on work (record_autoscaling_stats): the step on the device now and the
        # recent steps as (end, device seconds, patches), appended on the event loop only.
        self._running_patches, self._running_since = 0, 0.0
        self._steps: deque[tuple[float, float, int]] = deque(maxlen=4096)
        self._calls: deque[tuple[float, int]] = deque(maxlen=4096)  # (admitted, patches)

    # -- queries -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model": self.cfg.model,
            "family": e.family,
            "fingerprint": e.fingerprint,
            # what an LLM server checks it serves the same model by (vitserve.keys)
            "identity": e.identity,
            "dtype": dtype_name(e.dtype),
            "device": str(e.device),
            "namespace": e.namespace,
            # how the model samples a video (part of a video's key); None: it takes none
            "video": e.video_settings,
            # and each way an encode may ask for (``VideoFor``: the model's, vLLM's; None: refused)
            "video_for": {w.value: e.video_settings_for(w) for w in VideoFor},
            "max_batch_patches": e.max_batch_patches,
            "budget_bytes": e.budget_bytes,
            "preprocess_at": self.cfg.preprocess_at,
        }

    def work_terms(self) -> Terms:
        """What the ingress refuses at the door by (``vitserve.encoder.work.Terms``)."""
        return self.terms

    def counters(self) -> dict[str, Any]:
        c = self.engine.counters
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "forward_calls": c.forward_calls,
            "images": c.images,
            "patches": c.patches,
            "oversize": c.oversize,
            "admitted": {
                "patches": self.budget.patches,
                "bytes": self.budget.nbytes,
                "refused": self.budget.refused,
            },
            "recent_forwards": list(self._forwards),
            "seconds": dict(self._seconds),
            "forward_calls_by_bucket": {str(k): v for k, v in c.forward_calls_by_bucket.items()},
            "counts": metrics.counts(),  # this replica's metric counters, exact at once
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook (called every few hundred ms; its values reach the autoscaling policy
        as custom metrics): patches queued and running, and over the last
        ``STATS_WINDOW_S`` the patches per busy device-second (0 when nothing ran), the busy
        fraction and the mean patches of the calls admitted (0: none). See
        vitserve.deployments.encoder.autoscaling. Runs on the event loop, like
        the queue's updates, so it reads them without locks."""
        now = time.perf_counter()
        while self._steps and self._steps[0][0] < now - autoscaling.STATS_WINDOW_S:
            self._steps.popleft()
        while self._calls and self._calls[0][0] < now - autoscaling.STATS_WINDOW_S:
            self._calls.popleft()
        calls = sum(p for _, p in self._calls) / len(self._calls) if self._calls else 0.0
        done = sum(p for _, _, p in self._steps)
        rate_busy = sum(s for _, s, _ in self._steps)  # the finished steps' device time
        busy = rate_busy + (now - self._running_since if self._running_patches else 0.0)
        return {
            autoscaling.QUEUED_PATCHES: float(self.queue.queued_patches()),
            autoscaling.RUNNING_PATCHES: float(self._running_patches),
            autoscaling.PATCHES_PER_S: done / rate_busy if rate_busy > 0 else 0.0,
            autoscaling.BUSY_FRACTION: min(1.0, busy / autoscaling.STATS_WINDOW_S),
            autoscaling.CALL_PATCHES: calls,
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook (every ``request_router.STATS_PERIOD_S``; the values reach the encoder's
        request router, :mod:`~vitserve.deployments.encoder.routing`): the patches admitted here
        and not yet done, in all and by caller, and the room the router fills this replica to:
        half the patches admission allows (two full forwards by default: one running, one
        ready), so the rest of a backlog waits in the router for whichever replica frees first.
        Runs on the event loop, like admission, so it reads the budget without locks."""
        return {
            routing.ADMITTED_PATCHES: self.budget.patches,
            routing.BY_CALLER: dict(self.budget.by_caller),
            routing.ROOM_PATCHES: max(1, self.budget.capacity.max_patches // 2),
        }

    # -- encoding ------------------------------------------------------------------------------
    async def encode(
        self, batch: EncodeBatch, prepared: list[Any] | None = None
    ) -> list[EncodedItem | ErrorItem]:
        """One request's missing images -> one result (or error item) per image, in order.

        In the event-loop turn it arrives in, before any pixel is decoded, each image gets its
        single-flight role and the request's work is admitted (BackpressureError, 429, if it
        does not fit now; LimitExceededError, 413, if it never would). Then it runs as a task
        of its own: a caller that goes away (its client disconnected) leaves it to finish and
        publish, still counted by admission, and never leaves a flight unsettled."""
        if self._store_reporter is None:
            self._store_reporter = asyncio.create_task(self._report_store_forever())
        if prepared is None and (batch.images is None or self._cpu_pool is None):
            raise ValueError("images arrive as bytes only with preprocess_at: encoder")
        started = time.perf_counter()
        store = self._store_for(batch.namespace)
        if batch.claims_at not in (CLAIMS_UNSTATED, store.connection.claim_scope):  # split
            raise StoreSplitError(str(store.connection.claim_scope), str(batch.claims_at))
        roles = self.flights.roles(batch.keys, batch.claims)
        # the cost of each image this request may encode here (a joined one costs nothing)
        works = self._works(batch, prepared, [i for i, r in enumerate(roles) if r is not Role.JOIN])
        try:
            ticket = self.budget.take(works, decoding=prepared is None, caller=batch.caller)
            self._calls.append((time.perf_counter(), sum(w.patches for w in works.values())))
        except VitserveError as exc:
            metrics.inc("admission_refused_total", limit=type(exc).__name__)
            raise
        futures = self.flights.begin(batch.keys, roles)
        run = asyncio.create_task(self._run(batch, prepared, store, roles, futures, works, ticket))
        results = await asyncio.shield(run)
        metrics.observe("encode_latency_seconds", time.perf_counter() - started)
        return results

    def _works(
        self, batch: EncodeBatch, prepared: list[Any] | None, indices: list[int]
    ) -> dict[int, ImageWork]:
        """The cost of images ``indices``: from their headers (bytes), or their prepared arrays
        (nothing for an image the preprocessor refused)."""
        if prepared is not None:
            return {
                i: ImageWork(0, 0, 0)
                if is_error(prepared[i])
                else ImageWork(prepared[i].patches, prepared[i].pixels.nbytes, 0)
                for i in indices
            }
        images, limits = batch.images or [], self.preprocessor.limits
        terms, videos = self.terms, self.preprocessor.video_limits
        return {
            i: image_work(
                terms.rule,
                images[i],
                batch.indices[i],
                limits,
                video=terms.sampling(batch.video_for),
                video_limits=videos,
            )
            for i in indices
        }

    def _store_for(self, namespace: str | None) -> EmbeddingStore:
        """The store of a batch's namespace (None: the config's), over this replica's one
        connection: ``self.store`` for the config's, a tenant's otherwise."""
        namespace = self.cfg.namespace if namespace is None else namespace
        return self.store if namespace == self.store.namespace else self._views.get(namespace)

    async def _run(
        self,
        batch: EncodeBatch,
        prepared: list[Any] | None,
        store: EmbeddingStore,
        roles: list[Role],
        futures: dict[int, asyncio.Future],
        works: dict[int, ImageWork],
        ticket: Ticket,
    ) -> list[Any]:
        """The admitted request: lead, wait, join; the ticket closed and every flight it leads
        settled at the end, whatever happens."""
        results: list[Any] = [None] * len(batch.keys)
        leads = [i for i, r in enumerate(roles) if r is Role.LEAD]
        # claims won by images that join a flight here: that flight's claim covers them
        self.flights.release_later(
            store,
            [
                (batch.keys[i], batch.token)
                for i, r in enumerate(roles)
                if r is Role.JOIN and batch.claims[i] is ClaimState.WON
            ],
        )
        tasks = [self._lead(batch, prepared, store, leads, futures, results, ticket)]
        tasks += [
            self._wait(batch, prepared, store, i, works[i], results, ticket)
            for i, r in enumerate(roles)
            if r is Role.WAIT
        ]
        try:
            done = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [e for e in done if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
            for i, role in enumerate(roles):
                if role is Role.JOIN:
                    results[i] = await self.flights.join(futures[i])
        finally:
            ticket.close()
            for i in leads:  # settled by now unless something failed before their step
                self.flights.settle(futures[i], error=RuntimeError("the encode stopped early"))
        return results

    async def _prepare(
        self, batch: EncodeBatch, prepared: list[Any] | None, indices: list[int]
    ) -> list[Any]:
        """The images ``indices`` prepared (in the CPU pool when they came as bytes), each a
        PreparedImage or its error item."""
        if prepared is not None:
            return [prepared[i] for i in indices]
        if not indices:
            return []
        images = batch.images or []
        return await asyncio.get_running_loop().run_in_executor(
            self._cpu_pool,
            prepare_all,
            self.preprocessor,
            [images[i] for i in indices],
            [batch.keys[i] for i in indices],
            [batch.indices[i] for i in indices],
            batch.video_for,
        )

    def _queue(
        self,
        batch: EncodeBatch,
        store: EmbeddingStore,
        items: list[tuple[int, Any, str | None]],
        futures: dict[int, asyncio.Future],
        results: list[Any],
        ticket: Ticket,
    ) -> list[asyncio.Future]:
        """Put prepared images on the device queue, each ``(index, prepared or error item,
        token of the claim its publish releases)``; their flights follow the queue's futures.
        A refused image settles its flight with its error item (and its claim is released)."""
        good, releases = [], []
        for i, p, token in items:
            if is_error(p):
                results[i] = p
                self.flights.settle(futures[i], p)
                ticket.release(i)
                if token is not None:
                    releases.append((batch.keys[i], token))
            else:
                good.append((i, p, token))
        self.flights.release_later(store, releases)
        queued = self.queue.enqueue(
            [p for _, p, _ in good],
            [Publish(store, None if t is None else (batch.keys[i], t)) for i, _, t in good],
        )
        for (i, _, _), future in zip(good, queued, strict=True):
            self.flights.follow(futures[i], future)
            future.add_done_callback(functools.partial(_release_on_done, ticket, i))
        return queued

    async def _lead(
        self,
        batch: EncodeBatch,
        prepared: list[Any] | None,
        store: EmbeddingStore,
        leads: list[int],
        futures: dict[int, asyncio.Future],
        results: list[Any],
        ticket: Ticket,
    ) -> None:
        """The images this request encodes: prepared, queued, their results."""
        ready = await self._prepare(batch, prepared, leads)
        ticket.release_decode()
        items = [
            (i, p, batch.token if batch.claims[i] is ClaimState.WON else None)
            for i, p in zip(leads, ready, strict=True)
        ]
        queued = self._queue(batch, store, items, futures, results, ticket)
        for (i, _, _), result in zip(
            [it for it in items if not is_error(it[1])], await asyncio.gather(*queued), strict=True
        ):
            results[i] = result

    async def _wait(
        self,
        batch: EncodeBatch,
        prepared: list[Any] | None,
        store: EmbeddingStore,
        i: int,
        work: ImageWork,
        results: list[Any],
        ticket: Ticket,
    ) -> None:
        """An image another caller claimed: its header once published; else (the claimant gave
        up, the wait timed out, the store failed) encoded here after all, joining a flight of
        this replica if one started meanwhile."""
        key = batch.keys[i]
        sf = self.cfg.single_flight
        waited = await self.flights.wait(store, key, sf.wait_timeout_s)
        if waited.header is not None:
            ticket.release(i)
            results[i] = describe_header(waited.header)
            return
        role, future, token = await self.flights.take_over(store, key, sf.claim_ttl_s)
        if role is Role.JOIN:
            ticket.release(i)
            results[i] = await self.flights.join(future)
            return
        try:
            decoding = None
            if prepared is None:  # its decoding was not counted: take it now, or refuse it
                decoding = self.budget.take_decoding(work.decode_bytes)
            try:
                [p] = await self._prepare(batch, prepared, [i])
            finally:
                if decoding is not None:
                    decoding.close()
            # one image: one future, or none where the queue refused it (its error item set)
            for queued in self._queue(batch, store, [(i, p, token)], {i: future}, results, ticket):
                results[i] = await queued
        except VitserveError as exc:  # no room to decode it now: this image fails, retryable
            results[i] = error_item(exc)
            self.flights.settle(future, results[i])
            if token is not None:
                self.flights.release_later(store, [(key, token)])
        finally:
            self.flights.settle(future, error=RuntimeError("the encode stopped early"))

    async def _encode_and_publish(self, work: list[Work]) -> list[EncodedItem]:
        """One device step (the queue's ``run_step``): forward, then one publish per namespace
        in the step (one, unless tenants share it) that also releases their claims.

        The step answers once its publishes are handed to the publish thread and the previous
        step's have ended, while its own still run, if every image in it is claimed: until the
        publish releases a claim, a reader that misses the key waits for it (the stores' rule,
        ``vitserve.cache.base``), so the answer need not wait for the record to land. A step
        with an unclaimed image (its store failed the lookup) answers after its publish. So at
        most one step's records are in flight past their answers (``_last_publish``), and
        ``__del__`` waits for them. A failed step or publish releases its claims (off the
        path)."""
        items = [w.prepared for w in work]
        # id(store) -> (store, indices of its work, the claims its publish releases)
        groups: dict[int, tuple[Any, list[int], list[tuple[str, str]]]] = {}
        for i, w in enumerate(work):
            group = groups.setdefault(id(w.publish.store), (w.publish.store, [], []))
            group[1].append(i)
            if w.publish.release is not None:
                group[2].append(w.publish.release)
        start = time.perf_counter()
        for w in work:
            metrics.observe("stage_seconds", start - w.arrived, stage="queue_wait")
        self._running_patches = patches = sum(p.patches for p in items)
        self._running_since = start
        try:
            results, values, plan = await asyncio.get_running_loop().run_in_executor(
                self._device_pool, self._forward_and_encode, items
            )
        except Exception:
            log.exception("encoding %d images failed", len(items))
            for store, _, releases in groups.values():
                self.flights.release_later(store, releases)
            raise
        finally:
            self._running_patches = 0
        encoded = time.perf_counter()
        self._steps.append((encoded, encoded - start, patches))
        self._seconds["forward_and_encode"] += encoded - start
        metrics.observe("stage_seconds", encoded - start, stage="forward")
        self._record_forwards(items, plan)
        metrics.inc("images_encoded_total", len(items))
        # handed to the publish thread now, before any answer leaves
        self._last_puts = [
            self._publish_pool.submit(
                store.put_values, [values[i] for i in indices], None, releases
            )
            for store, indices, releases in groups.values()
        ]
        puts = [
            (store, [values[i] for i in indices], releases, asyncio.wrap_future(put))
            for (store, indices, releases), put in zip(
                groups.values(), self._last_puts, strict=True
            )
        ]
        publishing = asyncio.ensure_future(self._published(puts, encoded))
        previous, self._last_publish = self._last_publish, publishing
        if previous is not None:
            await asyncio.shield(previous)
        if any(w.publish.release is None for w in work):
            failed = await asyncio.shield(publishing)
            # what its caller cannot find in the store yet: said in the answer, so a client
            # that misses it after encoding it again is told the store failed, not that the
            # record was evicted (the publish is tried again in the background)
            for position, (_, indices, _) in enumerate(groups.values()):
                if position in failed:
                    for i in indices:
                        results[i] = unpublished(results[i])
        return results

    async def _published(
        self,
        puts: list[tuple[Any, list[tuple[str, bytes]], list[tuple[str, str]], asyncio.Future]],
        encoded: float,
    ) -> set[int]:
        """A step's publishes, awaited: counted and timed; the positions in ``puts`` of those
        that failed. One the store refused as unavailable is tried again in the background
        (``_publish_again``); one that failed otherwise is logged and its claims are released,
        so readers waiting on them stop waiting (the embeddings were computed and answered: a
        reader then misses and the client encodes again)."""
        failed: set[int] = set()
        for position, (store, values, releases, put) in enumerate(puts):
            try:
                with metrics.timed("store_round_trip_seconds", op="put"):
                    await put
                metrics.inc("bytes_published_total", sum(len(v) for _, v in values))
            except Exception as exc:
                failed.add(position)
                metrics.inc("store_errors_total", op="put")
                if (
                    isinstance(exc, StoreUnavailableError)
                    and len(self._republishing) < MAX_REPUBLISHING
                ):
                    log.warning("publishing embeddings failed, trying again: %s", exc)
                    self._publish_again(store, values, releases)
                    continue
                if isinstance(exc, StoreError):
                    log.warning("publishing embeddings failed: %s", exc)
                else:
                    log.exception("publishing embeddings failed")
                self.flights.release_later(store, releases)
        published = time.perf_counter() - encoded
        self._seconds["publish"] += published
        metrics.observe("stage_seconds", published, stage="publish")
        return failed

    def _publish_again(
        self, store: Any, values: list[tuple[str, bytes]], releases: list[tuple[str, str]]
    ) -> None:
        """Try a publish the store refused as unavailable again after each of PUBLISH_RETRY_S
        (on the republish thread, in a task of its own: no step or answer waits for it), its
        claims held till it lands; then give it up and release them."""

        async def again() -> None:
            loop = asyncio.get_running_loop()
            failure: Exception | None = None
            for wait in PUBLISH_RETRY_S:
                await asyncio.sleep(wait)
                try:
                    await loop.run_in_executor(
                        self._republish_pool, store.put_values, values, None, releases
                    )
                except StoreUnavailableError as exc:
                    failure = exc
                    metrics.inc("store_errors_total", op="put")
                    continue
                except Exception as exc:
                    failure = exc
                    metrics.inc("store_errors_total", op="put")
                    break
                metrics.inc("bytes_published_total", sum(len(v) for _, v in values))
                return
            log.warning("publishing embeddings failed, given up: %s", failure)
            self.flights.release_later(store, releases)

        task = asyncio.create_task(again())
        self._republishing.add(task)
        task.add_done_callback(self._republishing.discard)

    async def drain_publishes(self) -> None:
        """Wait until the publishes handed to the publish thread have ended (tests): the
        latest step's is the only one that can still run (``_encode_and_publish``), with the
        publishes being tried again (``_publish_again``)."""
        while self._last_publish is not None and not self._last_publish.done():
            await asyncio.shield(self._last_publish)
        while self._republishing:
            await asyncio.gather(*list(self._republishing), return_exceptions=True)

    def _record_forwards(self, items: list[Any], plan: Any) -> None:
        """Metrics and the recent-forwards log: per forward its bucket, the buckets of the
        images it ran (one, by the planner's invariant) and its padding."""
        packs = self.engine.adapter.packs_sequences
        for batch in plan.batches:
            members = [items[i] for i in batch.indices]
            lengths = [p.seq_len for p in members]
            tokens = sum(lengths) if packs else len(lengths) * max(lengths)
            padded = tokens - sum(lengths)
            metrics.inc("tower_forward_calls_total", bucket=str(batch.bucket))
            metrics.observe("batch_images", batch.num_items)
            metrics.observe("batch_patches", batch.patches)
            metrics.observe("padded_token_fraction", padded / tokens)
            self._forwards.append(
                {
                    "bucket": str(batch.bucket),
                    "images": batch.num_items,
                    "item_buckets": sorted({str(p.bucket) for p in members}),
                    "tokens": tokens,
                    "padded_tokens": padded,
                }
            )

    def _forward_and_encode(
        self, items: list[Any]
    ) -> tuple[list[EncodedItem], list[tuple[str, Any]], Any]:
        """Worker thread: plan, forward, and encode each embedding into its record."""
        plan = self.engine.plan(items)
        embeddings = self.engine.run(items, plan)
        results, values = [], []
        for e in embeddings:
            value = encode_record(embedding_record(e, self.engine.fingerprint))
            values.append((e.key, value))
            results.append(describe_header(read_header(value)))
        return results, values, plan

    async def _report_store_forever(self, period_s: float = 1.0) -> None:
        """Keep the store gauge fresh: Ray drops a gauge not set for two report intervals,
        and evictions happen whenever any replica publishes."""
        while not self._stopping:
            try:
                await asyncio.to_thread(self._report_store)
            except Exception:  # a metrics fault must not end the reporting, nor anything else
                if self._stopping:  # the replica stops (its executors refuse work): so do we
                    return
                log.exception("reporting store stats failed")
            await asyncio.sleep(period_s)

    def __del__(self) -> None:
        """Serve calls this when it stops the replica (an application deleted, scaled down),
        once its requests are answered: let the puts still running end (the latest step's: the
        publish thread runs them in order, after any before them), for at most a claim's ttl,
        after which readers no longer wait on them anyway; and end the store reporter, which
        would otherwise meet the executors' shutdown. (When the garbage collector calls it,
        nothing is pending: a running put keeps this object reachable through its step.)"""
        puts = getattr(self, "_last_puts", [])
        if puts:
            wait_all(puts, timeout=self.cfg.single_flight.claim_ttl_s)
        self._stopping = True
        task = getattr(self, "_store_reporter", None)
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                task.get_loop().call_soon_threadsafe(task.cancel)

    def _report_store(self) -> None:
        try:
            stats = self.store.stats()
        except StoreError:
            return
        evictions = stats.get("evictions", 0) + stats.get("local_evictions", 0)
        metrics.inc("store_evictions_total", self._evictions.step(evictions))
        metrics.set_gauge("cache_evictions", evictions)  # the deprecated gauge, until 0.2
