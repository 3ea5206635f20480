"""The encoder and preprocessing deployments.

``EncoderDeployment`` (one replica per GPU, or CPU) holds an :class:`EncoderEngine`. It takes
**one call per request**: ``encode(batch, prepared)`` with all of the request's images that the
ingress found missing (:class:`EncodeBatch`) and answers with their results in order.

* Preprocessing runs where the config's ``preprocess_at`` says: in this replica's CPU threads
  (the images arrive as bytes), in the ingress, or in ``PreprocessDeployment`` (CPU replicas
  that scale apart; its answer reaches this replica by reference through the object store).
  A bad image fails alone: its item carries the error.
* Batching is :class:`~vitserve.deployments.device_queue.DeviceQueue`, the one queue between
  callers and the device (its docstring states the rule), so concurrent requests share forwards.
* Admission (:class:`~vitserve.deployments.admission.WorkBudget`): a request's new images are
  admitted by their patches and bytes, read from their headers before any pixel is decoded,
  or the request is refused at once (429; 413 if it could never fit).
* Single flight (:class:`~vitserve.deployments.single_flight.SingleFlight`, which states the
  rule): a won image is encoded and published with its claim released in the same store call;
  an image already being encoded on this replica (from the moment its request arrived) is
  joined; a busy one is awaited on the store without holding a thread, and encoded here only if
  its claimant gave up. Store failures never fail an encode (they are counted).
* So a new image costs two store round trips on its path (the ingress's lookup-or-claim and
  the publish), and this replica makes none before its forward.
* Namespaces (tenants, see ``vitserve.deployments.auth``): each batch names the namespace its
  images are keyed in; claims, waits and the publish go to that namespace's view of this
  replica's one store (a device step that mixes namespaces publishes once per namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray import serve

from vitserve.deployments import autoscaling, metrics
from vitserve.deployments.admission import Ticket, WorkBudget, image_work
from vitserve.deployments.config import VitserveConfig
from vitserve.deployments.device_queue import DeviceQueue, Work
from vitserve.deployments.single_flight import ClaimState, Role, SingleFlight
from vitserve.encoder.work import ImageWork, Terms
from vitserve.errors import ImageError, StoreError, VitserveError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log


@dataclass(slots=True)
class EncodeBatch:
    """One request's images for the encoder: keys, positions in the request (for errors), each
    image's claim state and the token the won claims are held under, the image bytes when
    the encoder preprocesses them (``None`` when ``prepared`` comes with the call), and the
    namespace the keys are in (the request's tenant; ``None``: the config's namespace)."""

    keys: list[str]
    indices: list[int]
    claims: list[ClaimState]
    token: str
    images: list[bytes] | None = None
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class Publish:
    """Where a queued image's embedding goes (the device queue carries it opaquely): the store
    view of its namespace, and the claim its publish releases (``(key, token)``) or None."""

    store: Any
    release: tuple[str, str] | None


def embedding_record(embedding: Any, fingerprint: str) -> Any:
    """The store record of an engine ``Embedding``: numpy views of its tensors (bf16 as raw
    16-bit words); tensors on a GPU are copied to host memory first (a store holds bytes)."""
    import torch

    from vitserve.cache.codec import EmbeddingRecord
    from vitserve.encoder.device import dtype_name

    def host(t: torch.Tensor) -> np.ndarray:
        t = t.detach().to("cpu")  # no copy when already on the CPU
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    tensors = {"embedding": host(embedding.tensor)}
    tensors |= {name: host(t) for name, t in embedding.extras.items()}
    return EmbeddingRecord(key=embedding.key, fingerprint=fingerprint,
                           dtype=dtype_name(embedding.tensor.dtype),
                           num_tokens=embedding.num_tokens, grid=embedding.grid,
                           tensors=tensors)  # fmt: skip


def describe_header(header: Any) -> dict[str, Any]:
    """The API's description of a stored embedding, from its record header."""
    return {
        "key": header.key,
        "num_tokens": header.num_tokens,
        "grid": list(header.grid) if header.grid else None,
        "dtype": header.dtype,
        "shape": [header.num_tokens, header.tensors[0].width],
        "extras": [t.name for t in header.tensors[1:]],
    }


def error_item(exc: VitserveError) -> dict[str, Any]:
    return {"error": {**exc.to_dict(), "status": exc.http_status}}


def prepare_all(preprocessor: Any, images: list[bytes], keys: list[str],
                indices: list[int]) -> list[Any]:  # fmt: skip
    """Each image's PreparedImage, or its error item (a bad image fails alone)."""
    out: list[Any] = []
    for data, key, index in zip(images, keys, indices, strict=True):
        start = time.perf_counter()
        try:
            out.append(preprocessor.prepare(data, key, index))
        except ImageError as exc:
            out.append(error_item(exc))
        metrics.observe("stage_seconds", time.perf_counter() - start, stage="preprocess")
    return out


def make_preprocessor(cfg: VitserveConfig, adapter: Any = None) -> Any:
    """The config's preprocessor (the model's image processor; no weights), under its limits."""
    from vitserve.encoder.images import ImageLimits
    from vitserve.encoder.preprocess import Preprocessor

    limits = ImageLimits(max_image_bytes=cfg.limits.max_image_bytes,
                         max_image_pixels=cfg.limits.max_image_pixels)  # fmt: skip
    if adapter is not None:
        return Preprocessor(adapter, limits)
    return Preprocessor.from_pretrained(cfg.model, revision=cfg.revision, limits=limits)


@serve.deployment
class PreprocessDeployment:
    """CPU replicas that decode and preprocess (``preprocess_at: deployment``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from vitserve.encoder.device import tune_cpu_allocator

        tune_cpu_allocator()  # see WORKER_ENV in app.py
        self.preprocessor = make_preprocessor(VitserveConfig.model_validate(config))

    def prepare(self, batch: EncodeBatch) -> list[Any]:
        """Each image of the batch prepared, or its error item."""
        return prepare_all(self.preprocessor, batch.images or [], batch.keys, batch.indices)


@serve.deployment
class EncoderDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from vitserve.cache import open_store
        from vitserve.encoder.engine import EncoderEngine

        cfg = VitserveConfig.model_validate(config)
        self.cfg = cfg
        threads = cfg.torch_threads or (None if torch.cuda.is_available() else os.cpu_count())
        if threads:
            torch.set_num_threads(threads)
        # Forwards run one at a time on one thread of their own. OpenMP's thread count is per
        # thread, and a new thread starts from OMP_NUM_THREADS, which Ray sets to the replica's
        # num_cpus (1): oneDNN's bf16 kernels then ran on one core while aten's ran on all
        # (448px forwards ~20% slower than in-process). The device thread sets it first.
        self._device_pool = ThreadPoolExecutor(
            1, thread_name_prefix="vitserve-device",
            initializer=torch.set_num_threads if threads else None,
            initargs=(threads,) if threads else (),
        )  # fmt: skip
        # Preprocessing (preprocess_at: encoder) on the node's cores, beside the forwards.
        self._cpu_pool: ThreadPoolExecutor | None = None
        if cfg.preprocess_at == "encoder":
            self._cpu_pool = ThreadPoolExecutor(
                os.cpu_count() or 1, thread_name_prefix="vitserve-preprocess"
            )
        self.engine = EncoderEngine.from_pretrained(
            cfg.model, device=cfg.device, dtype=cfg.dtype, budget_bytes=cfg.budget_bytes,
            max_batch_patches=cfg.batching.max_batch_patches, revision=cfg.revision,
            namespace=cfg.namespace,
        )  # fmt: skip
        self.preprocessor = make_preprocessor(cfg, self.engine.adapter)  # no load: the engine's
        from vitserve.cache.views import StoreViews
        from vitserve.deployments.auth import root_namespace

        # One store object (one connection) for every namespace: with auth on it has none of
        # its own and each tenant's namespace is a view of it.
        self.store = open_store(cfg.store, namespace=root_namespace(cfg),
                                fingerprint=self.engine.fingerprint)  # fmt: skip
        self._views = StoreViews(self.store)
        # One cap for the queue's steps and the engine's forwards (config, else the engine's).
        self.queue = DeviceQueue(self._encode_and_publish,
                                 max_batch_patches=self.engine.max_batch_patches,
                                 wait_s=cfg.batching.batch_wait_timeout_s,
                                 enabled=cfg.batching.enabled)  # fmt: skip
        # What this replica admits (from the activation budget unless configured), and how an
        # image's cost is read from its header (the ingress gets the same terms: ``terms``).
        self.terms = self.engine.terms(max_image_pixels=cfg.limits.max_image_pixels,
                                       max_patches=cfg.admission.max_patches,
                                       max_bytes=cfg.admission.max_bytes)  # fmt: skip
        self.budget = WorkBudget(self.terms.capacity)
        self.flights = SingleFlight(hook=metrics.flight_hook("encoder"))
        # Publishes have a thread of their own: nothing else (single flight's polls, a slow
        # store call) can hold up the device loop's publish.
        self._publish_pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-publish")
        self._forwards: deque[dict[str, Any]] = deque(maxlen=256)  # the latest forwards
        self._seconds: Counter[str] = Counter()  # device-step time by phase
        self._store_reporter: asyncio.Task | None = None
        self._stopping = False  # set when Serve stops the replica (``__del__``)
        # Autoscaling on work (record_autoscaling_stats): the step on the device now and the
        # recent steps as (end, device seconds, patches), appended on the event loop only.
        self._running_patches, self._running_since = 0, 0.0
        self._steps: deque[tuple[float, float, int]] = deque(maxlen=4096)

    # -- queries -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        from vitserve.encoder.device import dtype_name

        e = self.engine
        return {"model": self.cfg.model, "family": e.family, "fingerprint": e.fingerprint,
                "dtype": dtype_name(e.dtype), "device": str(e.device),
                "namespace": e.namespace, "max_batch_patches": e.max_batch_patches,
                "budget_bytes": e.budget_bytes,
                "preprocess_at": self.cfg.preprocess_at}  # fmt: skip

    def work_terms(self) -> Terms:
        """What the ingress refuses at the door by (``vitserve.encoder.work.Terms``)."""
        return self.terms

    def counters(self) -> dict[str, Any]:
        c = self.engine.counters
        return {"replica": serve.get_replica_context().replica_id.unique_id,
                "forward_calls": c.forward_calls, "images": c.images, "patches": c.patches,
                "oversize": c.oversize,
                "admitted": {"patches": self.budget.patches, "bytes": self.budget.nbytes,
                             "refused": self.budget.refused},
                "recent_forwards": list(self._forwards),
                "seconds": dict(self._seconds),
                "forward_calls_by_bucket": {str(k): v for k, v in
                                            c.forward_calls_by_bucket.items()}}  # fmt: skip

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook (called every few hundred ms; its values reach the autoscaling policy
        as custom metrics): patches queued and running, and over the last
        ``STATS_WINDOW_S`` the patches per busy device-second (0 when nothing ran) and the
        busy fraction. See vitserve.deployments.autoscaling. Runs on the event loop, like
        the queue's updates, so it reads them without locks."""
        now = time.perf_counter()
        while self._steps and self._steps[0][0] < now - autoscaling.STATS_WINDOW_S:
            self._steps.popleft()
        done = sum(p for _, _, p in self._steps)
        rate_busy = sum(s for _, s, _ in self._steps)  # the finished steps' device time
        busy = rate_busy + (now - self._running_since if self._running_patches else 0.0)
        return {autoscaling.QUEUED_PATCHES: float(self.queue.queued_patches()),
                autoscaling.RUNNING_PATCHES: float(self._running_patches),
                autoscaling.PATCHES_PER_S: done / rate_busy if rate_busy > 0 else 0.0,
                autoscaling.BUSY_FRACTION: min(1.0, busy / autoscaling.STATS_WINDOW_S)}  # fmt: skip

    # -- encoding ------------------------------------------------------------------------------
    async def encode(self, batch: EncodeBatch, prepared: list[Any] | None = None) -> list[dict]:
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
        roles = self.flights.roles(batch.keys, batch.claims)
        # the cost of each image this request may encode here (a joined one costs nothing)
        works = self._works(batch, prepared, [i for i, r in enumerate(roles)
                                              if r is not Role.JOIN])  # fmt: skip
        try:
            ticket = self.budget.take(works, decoding=prepared is None)
        except VitserveError as exc:
            metrics.inc("admission_refused_total", limit=type(exc).__name__)
            raise
        futures = self.flights.begin(batch.keys, roles)
        run = asyncio.create_task(self._run(batch, prepared, store, roles, futures, works,
                                            ticket))  # fmt: skip
        results = await asyncio.shield(run)
        metrics.observe("encode_latency_seconds", time.perf_counter() - started)
        return results

    def _works(self, batch: EncodeBatch, prepared: list[Any] | None,
               indices: list[int]) -> dict[int, ImageWork]:  # fmt: skip
        """The cost of images ``indices``: from their headers (bytes), or their prepared arrays
        (nothing for an image the preprocessor refused)."""
        if prepared is not None:
            return {i: ImageWork(0, 0, 0) if isinstance(prepared[i], dict) else
                    ImageWork(prepared[i].patches, prepared[i].pixels.nbytes, 0)
                    for i in indices}  # fmt: skip
        images, limits = batch.images or [], self.preprocessor.limits
        return {i: image_work(self.terms.rule, images[i], batch.indices[i], limits)
                for i in indices}  # fmt: skip

    def _store_for(self, namespace: str | None) -> Any:
        """The store of a batch's namespace (None: the config's): this replica's store for its
        own, else a view of it (auth on: the store has no namespace, the tenants' views add
        theirs)."""
        namespace = self.cfg.namespace if namespace is None else namespace
        return self.store if namespace == self.store.namespace else self._views.get(namespace)

    async def _run(self, batch: EncodeBatch, prepared: list[Any] | None, store: Any,
                   roles: list[Role], futures: dict[int, asyncio.Future],
                   works: dict[int, ImageWork], ticket: Ticket) -> list[Any]:  # fmt: skip
        """The admitted request: lead, wait, join; the ticket closed and every flight it leads
        settled at the end, whatever happens."""
        results: list[Any] = [None] * len(batch.keys)
        leads = [i for i, r in enumerate(roles) if r is Role.LEAD]
        # claims won by images that join a flight here: that flight's claim covers them
        self.flights.release_later(store, [(batch.keys[i], batch.token) for i, r in
                                           enumerate(roles) if r is Role.JOIN and
                                           batch.claims[i] is ClaimState.WON])  # fmt: skip
        tasks = [self._lead(batch, prepared, store, leads, futures, results, ticket)]
        tasks += [self._wait(batch, prepared, store, i, works[i], results, ticket)
                  for i, r in enumerate(roles) if r is Role.WAIT]  # fmt: skip
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

    async def _prepare(self, batch: EncodeBatch, prepared: list[Any] | None,
                       indices: list[int]) -> list[Any]:  # fmt: skip
        """The images ``indices`` prepared (in the CPU pool when they came as bytes), each a
        PreparedImage or its error item."""
        if prepared is not None:
            return [prepared[i] for i in indices]
        if not indices:
            return []
        images = batch.images or []
        return await asyncio.get_running_loop().run_in_executor(
            self._cpu_pool, prepare_all, self.preprocessor, [images[i] for i in indices],
            [batch.keys[i] for i in indices], [batch.indices[i] for i in indices],
        )  # fmt: skip

    def _queue(self, batch: EncodeBatch, store: Any, items: list[tuple[int, Any, str | None]],
               futures: dict[int, asyncio.Future], results: list[Any],
               ticket: Ticket) -> list[asyncio.Future]:  # fmt: skip
        """Put prepared images on the device queue, each ``(index, prepared or error item,
        token of the claim its publish releases)``; their flights follow the queue's futures.
        A refused image settles its flight with its error item (and its claim is released)."""
        good, releases = [], []
        for i, p, token in items:
            if isinstance(p, dict):
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
        )  # fmt: skip
        for (i, _, _), future in zip(good, queued, strict=True):
            self.flights.follow(futures[i], future)
            future.add_done_callback(lambda _, i=i: ticket.release(i))
        return queued

    async def _lead(self, batch: EncodeBatch, prepared: list[Any] | None, store: Any,
                    leads: list[int], futures: dict[int, asyncio.Future], results: list[Any],
                    ticket: Ticket) -> None:  # fmt: skip
        """The images this request encodes: prepared, queued, their results."""
        ready = await self._prepare(batch, prepared, leads)
        ticket.release_decode()
        items = [(i, p, batch.token if batch.claims[i] is ClaimState.WON else None)
                 for i, p in zip(leads, ready, strict=True)]  # fmt: skip
        queued = self._queue(batch, store, items, futures, results, ticket)
        for (i, _, _), result in zip([it for it in items if not isinstance(it[1], dict)],
                                     await asyncio.gather(*queued), strict=True):  # fmt: skip
            results[i] = result

    async def _wait(self, batch: EncodeBatch, prepared: list[Any] | None, store: Any, i: int,
                    work: ImageWork, results: list[Any], ticket: Ticket) -> None:  # fmt: skip
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
            [queued] = self._queue(batch, store, [(i, p, token)], {i: future}, results,
                                   ticket) or [None]  # fmt: skip
            if queued is not None:
                results[i] = await queued
        except VitserveError as exc:  # no room to decode it now: this image fails, retryable
            results[i] = error_item(exc)
            self.flights.settle(future, results[i])
            if token is not None:
                self.flights.release_later(store, [(key, token)])
        finally:
            self.flights.settle(future, error=RuntimeError("the encode stopped early"))

    async def _encode_and_publish(self, work: list[Work]) -> list[dict[str, Any]]:
        """One device step (the queue's ``run_step``): forward, then one publish per namespace
        in the step (one, unless tenants share it) that also releases their claims. A failed
        step releases them too (off the path)."""
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
        for store, indices, releases in groups.values():
            mine = [values[i] for i in indices]
            try:
                with metrics.timed("store_round_trip_seconds", op="put"):
                    await asyncio.get_running_loop().run_in_executor(
                        self._publish_pool, store.put_values, mine, None, releases
                    )
                metrics.inc("bytes_published_total", sum(len(v) for _, v in mine))
            except StoreError as exc:  # the embeddings are computed; the callers get them
                metrics.inc("store_errors_total", op="put")
                log.warning("publishing %d embeddings failed: %s", len(mine), exc)
        published = time.perf_counter() - encoded
        self._seconds["publish"] += published
        metrics.observe("stage_seconds", published, stage="publish")
        return results

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
            self._forwards.append({"bucket": str(batch.bucket), "images": batch.num_items,
                                   "item_buckets": sorted({str(p.bucket) for p in members}),
                                   "tokens": tokens, "padded_tokens": padded})  # fmt: skip

    def _forward_and_encode(self, items: list[Any]) -> tuple[list[dict], list[tuple], Any]:
        """Worker thread: plan, forward, and encode each embedding into its record."""
        from vitserve.cache.codec import encode_record, read_header

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
        """Serve calls this when it stops the replica (an application deleted, scaled down):
        end the store reporter, which would otherwise meet the executors' shutdown."""
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
        metrics.set_gauge("cache_evictions", stats.get("evictions", 0)
                          + stats.get("local_evictions", 0))  # fmt: skip
