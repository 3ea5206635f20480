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
* Single flight: the ingress's ``lookup_or_claim`` claimed each new image (``won``) or found it
  claimed (``busy``). A won image is encoded and published with its claim released in the same
  store call. An image already being encoded on this replica is joined (one shared future); a
  busy one is awaited through the store (``wait_for``) and read back, and encoded here only if
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
from vitserve.deployments.config import VitserveConfig
from vitserve.deployments.device_queue import DeviceQueue, Work
from vitserve.errors import ImageError, StoreError, VitserveError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

#: how the ingress's ``lookup_or_claim`` left each image: the claim is the ingress's (``WON``),
#: someone else's (``BUSY``), or unknown because the store failed (``NONE``: encode, unclaimed)
WON, BUSY, NONE = "won", "busy", "none"


@dataclass(slots=True)
class EncodeBatch:
    """One request's images for the encoder: keys, positions in the request (for errors), each
    image's claim state and the token the won claims are held under, the image bytes when
    the encoder preprocesses them (``None`` when ``prepared`` comes with the call), and the
    namespace the keys are in (the request's tenant; ``None``: the config's namespace)."""

    keys: list[str]
    indices: list[int]
    claims: list[str]
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
        self._inflight: dict[str, asyncio.Future] = {}
        self._forwards: deque[dict[str, Any]] = deque(maxlen=256)  # the latest forwards
        self._seconds: Counter[str] = Counter()  # device-step time by phase
        self._background: set[asyncio.Task] = set()  # claim releases in flight
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

    def counters(self) -> dict[str, Any]:
        c = self.engine.counters
        return {"forward_calls": c.forward_calls, "images": c.images, "patches": c.patches,
                "oversize": c.oversize,
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
        """One request's missing images -> one result (or error item) per image, in order."""
        if self._store_reporter is None:
            self._store_reporter = asyncio.create_task(self._report_store_forever())
        started = time.perf_counter()
        if prepared is None:
            if batch.images is None or self._cpu_pool is None:
                raise ValueError("images arrive as bytes only with preprocess_at: encoder")
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._cpu_pool, prepare_all, self.preprocessor, batch.images, batch.keys,
                batch.indices,
            )  # fmt: skip
        store = self._store_for(batch.namespace)
        n = len(batch.keys)
        results: list[Any] = [None] * n
        joins: dict[int, asyncio.Future] = {}
        mine: list[int] = []  # images this call encodes (it owns their in-flight futures)
        busy: list[int] = []
        releases: list[tuple[str, str]] = []  # won claims this call will not publish
        for i, (key, claim, p) in enumerate(zip(batch.keys, batch.claims, prepared,
                                                strict=True)):  # fmt: skip
            pending = self._inflight.get(key)
            if isinstance(p, dict):  # the preprocessor refused the image
                results[i] = p
                if claim == WON:
                    releases.append((key, batch.token))
            elif pending is not None:  # already being encoded here: join it
                metrics.inc("single_flight_joins_total", scope="local")
                joins[i] = pending
                if claim == WON:  # (its claimant expired meanwhile): ours is not needed
                    releases.append((key, batch.token))
            elif claim == BUSY:
                busy.append(i)
            else:
                mine.append(i)
        if releases:
            self._release_later(store, releases)
        # Only images encoded here are joinable: a busy one waits on the store, and its claimant
        # arriving here later must encode it, not join the waiter.
        futures = {i: self._start_flight(batch.keys[i]) for i in mine}
        tasks = []
        if mine:
            tasks.append(self._encode_mine(batch, store, prepared, mine, results, futures))
        tasks += [self._encode_busy(store, prepared[i], i, results) for i in busy]
        try:
            await asyncio.gather(*tasks)
        finally:
            for i, future in futures.items():
                self._end_flight(batch.keys[i], future)
        for i, pending in joins.items():
            results[i] = await asyncio.shield(pending)
        metrics.observe("encode_latency_seconds", time.perf_counter() - started)
        return results

    def _store_for(self, namespace: str | None) -> Any:
        """The store of a batch's namespace (None: the config's): this replica's store for its
        own, else a view of it (auth on: the store has no namespace, the tenants' views add
        theirs)."""
        namespace = self.cfg.namespace if namespace is None else namespace
        return self.store if namespace == self.store.namespace else self._views.get(namespace)

    def _start_flight(self, key: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        return future

    def _end_flight(self, key: str, future: asyncio.Future) -> None:
        """Forget ``key``'s flight ``future``; if it ended before settling (cancelled, or its
        step raised past it), whoever joined it learns so."""
        self._settle(future, error=RuntimeError("the encode this image joined stopped"))
        if self._inflight.get(key) is future:
            del self._inflight[key]

    @staticmethod
    def _settle(future: asyncio.Future, result: Any = None,
                error: BaseException | None = None) -> None:  # fmt: skip
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
            future.exception()  # retrieved: waiters re-raise it, nobody else needs to
        else:
            future.set_result(result)

    async def _encode_mine(self, batch: EncodeBatch, store: Any, prepared: list[Any],
                           mine: list[int], results: list[Any],
                           futures: dict[int, asyncio.Future]) -> None:  # fmt: skip
        publish = [Publish(store, (batch.keys[i], batch.token) if batch.claims[i] == WON
                           else None) for i in mine]  # fmt: skip
        try:
            done = await self.queue.submit([prepared[i] for i in mine], publish)
        except BaseException as exc:
            for i in mine:
                self._settle(futures[i], error=exc)
            raise
        for i, result in zip(mine, done, strict=True):
            results[i] = result
            self._settle(futures[i], result)

    async def _encode_busy(self, store: Any, prepared: Any, i: int, results: list[Any]) -> None:
        """An image another caller claimed: wait for its publish and read it back; encode it
        here only if the claimant gave up (claiming it first, when the store answers), and
        not if this replica is encoding it by then (the claimant's encode may run here, or the
        store went down during the wait): join that instead."""
        key = prepared.key
        metrics.inc("single_flight_joins_total", scope="remote")
        sf = self.cfg.single_flight
        if await self._store_call("wait_for", store.wait_for, key, sf.wait_timeout_s,
                                  default=False):  # fmt: skip
            headers = await self._store_call("headers", store.headers_many, [key],
                                             default=[None])  # fmt: skip
            if headers[0] is not None:
                results[i] = describe_header(headers[0])
                return
        pending = self._inflight.get(key)
        if pending is not None:
            metrics.inc("single_flight_joins_total", scope="local")
            results[i] = await asyncio.shield(pending)
            return
        won = await self._store_call("claim", store.claim, key, sf.claim_ttl_s,
                                     default=False)  # fmt: skip
        if (pending := self._inflight.get(key)) is not None:  # started during the claim
            if won:
                self._release_later(store, [(key, store.token)])
            results[i] = await asyncio.shield(pending)
            return
        release = (key, store.token) if won else None
        future = self._start_flight(key)
        try:
            [results[i]] = await self.queue.submit([prepared], [Publish(store, release)])
            self._settle(future, results[i])
        finally:
            self._end_flight(key, future)

    def _release_later(self, store: Any, releases: list[tuple[str, str]]) -> None:
        """Release claims off the answer's path (one store call for them all)."""
        task = asyncio.create_task(self._store_call("release", store.put_values, [],
                                                    None, releases))  # fmt: skip
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _store_call(self, op: str, fn: Any, *args: Any, default: Any = None) -> Any:
        try:
            with metrics.timed("store_round_trip_seconds", op=op):
                return await asyncio.to_thread(fn, *args)
        except StoreError as exc:
            metrics.inc("store_errors_total", op=op)
            log.warning("store %s failed: %s", op, exc)
            return default

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
                if releases:
                    self._release_later(store, releases)
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
                    await asyncio.to_thread(store.put_values, mine, None, releases)
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
