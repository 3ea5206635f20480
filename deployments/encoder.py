"""The encoder and preprocessing deployments.

``PreprocessDeployment`` (CPU replicas) decodes and preprocesses images with the model's image
processor only (no weights) and returns a :class:`PreparedImage`: plain numpy, which Serve passes
to the encoder through the object store by reference when the ingress hands the response
straight to the encoder's handle (the ingress never fetches the pixels).

``EncoderDeployment`` (one replica per GPU, or CPU) holds an :class:`EncoderEngine`:

* Concurrent images are gathered with ``@serve.batch`` whose ``batch_size_fn`` counts patches,
  not images, up to ``max_batch_patches`` (the config's, else the engine's cap for its device);
  the engine's planner splits a gathered batch into uniform-bucket forwards under the
  activation budget; forwards run in a worker thread, one at a time, off the event loop. An
  image over the cap skips the gathering (Serve's queue refuses an item larger than its batch)
  and runs alone.
* Single flight: an image already being encoded on this replica is joined (one shared future);
  one being encoded on another replica is awaited through the store's claim (``claim`` /
  ``wait_for``), then read from the store. Store failures never fail an encode: the image is
  encoded (and the failure counted).
* Each embedding is published once, in the record format, under its content key.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from ray import serve

from vitserve.deployments import metrics
from vitserve.deployments.config import BatchingConfig, VitserveConfig
from vitserve.errors import ImageError, StoreError, VitserveError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

_BATCHING = BatchingConfig()  # the decorator's defaults; each replica sets its config's
# The most patches one gathered batch holds when the engine has no cap (GPUs).
UNCAPPED_GATHER_PATCHES = 32768


def _batch_patches(items: list[Any]) -> int:
    return sum(p.patches for p in items)


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


@serve.deployment
class PreprocessDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        from vitserve.encoder.device import tune_cpu_allocator
        from vitserve.encoder.images import ImageLimits
        from vitserve.encoder.preprocess import Preprocessor

        tune_cpu_allocator()  # see WORKER_ENV in app.py
        cfg = VitserveConfig.model_validate(config)
        limits = ImageLimits(max_image_bytes=cfg.limits.max_image_bytes,
                             max_image_pixels=cfg.limits.max_image_pixels)  # fmt: skip
        self.preprocessor = Preprocessor.from_pretrained(cfg.model, revision=cfg.revision,
                                                         limits=limits)  # fmt: skip

    def prepare(self, data: bytes, key: str, index: int) -> Any:
        """A PreparedImage, or an error item (a bad image fails alone, never the replica)."""
        try:
            with metrics.timed("stage_seconds", stage="preprocess"):
                return self.preprocessor.prepare(data, key, index)
        except ImageError as exc:
            return error_item(exc)


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
        self.engine = EncoderEngine.from_pretrained(
            cfg.model, device=cfg.device, dtype=cfg.dtype, budget_bytes=cfg.budget_bytes,
            max_batch_patches=cfg.batching.max_batch_patches, revision=cfg.revision,
            namespace=cfg.namespace,
        )  # fmt: skip
        self.store = open_store(cfg.store, namespace=cfg.namespace,
                                fingerprint=self.engine.fingerprint)  # fmt: skip
        # One cap for gathering and for the engine's forwards (config, else the engine's).
        self.max_batch_patches = self.engine.max_batch_patches or UNCAPPED_GATHER_PATCHES
        self._encode_batch.set_max_batch_size(self.max_batch_patches)
        self._encode_batch.set_batch_wait_timeout_s(cfg.batching.batch_wait_timeout_s)
        self._inflight: dict[str, asyncio.Future] = {}
        self._forwards: deque[dict[str, Any]] = deque(maxlen=256)  # the latest forwards
        self._seconds: Counter[str] = Counter()  # device-step time by phase
        self._background: set[asyncio.Task] = set()  # claim releases in flight
        self._store_reporter: asyncio.Task | None = None
        # The device queue: what Serve's batches handed over and the device has not taken yet.
        self._queued: list[tuple[Any, float, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._device_task: asyncio.Task | None = None

    # -- queries -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        from vitserve.encoder.device import dtype_name

        e = self.engine
        return {"model": self.cfg.model, "family": e.family, "fingerprint": e.fingerprint,
                "dtype": dtype_name(e.dtype), "device": str(e.device),
                "namespace": e.namespace, "max_batch_patches": e.max_batch_patches,
                "budget_bytes": e.budget_bytes}  # fmt: skip

    def counters(self) -> dict[str, Any]:
        c = self.engine.counters
        return {"forward_calls": c.forward_calls, "images": c.images, "patches": c.patches,
                "oversize": c.oversize,
                "recent_forwards": list(self._forwards),
                "seconds": dict(self._seconds),
                "forward_calls_by_bucket": {str(k): v for k, v in
                                            c.forward_calls_by_bucket.items()}}  # fmt: skip

    # -- encoding ------------------------------------------------------------------------------
    async def encode(self, prepared: Any) -> dict[str, Any]:
        """Encode one prepared image (or pass an error item through); single flight."""
        if self._store_reporter is None:
            self._store_reporter = asyncio.create_task(self._report_store_forever())
        if isinstance(prepared, dict):  # the preprocessor refused the image
            return prepared
        key = prepared.key
        pending = self._inflight.get(key)
        if pending is not None:
            metrics.inc("single_flight_joins_total", scope="local")
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            result = await self._encode_once(prepared)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        finally:
            del self._inflight[key]

    async def _store_call(self, op: str, fn: Any, *args: Any, default: Any = None) -> Any:
        try:
            with metrics.timed("store_round_trip_seconds", op=op):
                return await asyncio.to_thread(fn, *args)
        except StoreError as exc:
            metrics.inc("store_errors_total", op=op)
            log.warning("store %s failed: %s", op, exc)
            return default

    async def _published(self, key: str) -> dict[str, Any] | None:
        headers = await self._store_call("headers", self.store.headers_many, [key],
                                         default=[None])  # fmt: skip
        return describe_header(headers[0]) if headers[0] is not None else None

    async def _encode_once(self, prepared: Any) -> dict[str, Any]:
        started = time.perf_counter()
        key = prepared.key
        cached = await self._published(key)
        if cached is not None:
            metrics.inc("cache_hits_total")
            return cached
        metrics.inc("cache_misses_total")
        sf = self.cfg.single_flight
        won = await self._store_call("claim", self.store.claim, key, sf.claim_ttl_s,
                                     default=True)  # fmt: skip
        if not won:  # another replica is encoding it: wait for its publish
            metrics.inc("single_flight_joins_total", scope="remote")
            if await self._store_call("wait_for", self.store.wait_for, key, sf.wait_timeout_s,
                                      default=False):  # fmt: skip
                published = await self._published(key)
                if published is not None:
                    return published
            # the claimant gave up, failed or timed out: encode it here
        try:
            if self.cfg.batching.enabled and prepared.patches <= self.max_batch_patches:
                result = await self._encode_batch(prepared, started)
            else:  # batching off, or an image over the cap: it runs alone either way (and
                # Serve's batch queue refuses an item larger than its max_batch_size)
                [result] = await self._run([prepared], [started])
        finally:
            if won:  # off the answer's path: the embedding is already published (or failed)
                task = asyncio.create_task(self._store_call("release", self.store.release, key))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        metrics.observe("encode_latency_seconds", time.perf_counter() - started)
        return result

    # max_concurrent_batches is high on purpose: Serve runs its batches one at a time only by
    # holding each formed batch back until the previous one returns, so images that arrive
    # during a forward would each form a batch of one and run one by one; here every formed
    # batch reaches the device queue at once and the device loop merges them.
    @serve.batch(max_batch_size=UNCAPPED_GATHER_PATCHES,
                 batch_wait_timeout_s=_BATCHING.batch_wait_timeout_s, max_concurrent_batches=256,
                 batch_size_fn=_batch_patches)  # fmt: skip
    async def _encode_batch(self, items: list[Any], arrived: list[float]) -> list[dict[str, Any]]:
        return await self._run(items, arrived)

    async def _run(self, items: list[Any], arrived: list[float]) -> list[dict[str, Any]]:
        """Queue images for the device and wait for their results.

        Serve forms a batch as soon as its wait times out, even while the device is busy with
        the previous one; the device loop therefore takes everything queued when it becomes
        free (up to ``max_batch_patches``), so images that arrive during a forward share the
        next one instead of running one by one.
        """
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._queued.extend(zip(items, arrived, futures, strict=True))
        self._wakeup.set()
        if self._device_task is None or self._device_task.done():
            self._device_task = asyncio.create_task(self._device_loop())
        return list(await asyncio.gather(*futures))

    def _take(self) -> list[tuple[Any, float, asyncio.Future]]:
        """The next device step: queued images in arrival order up to the patch cap (at least
        one; one at a time when batching is off)."""
        if not self.cfg.batching.enabled:
            work, self._queued = self._queued[:1], self._queued[1:]
            return work
        cap = self.max_batch_patches
        take, patches = 1, min(self._queued[0][0].patches, cap)
        while take < len(self._queued):
            patches += min(self._queued[take][0].patches, cap)
            if patches > cap:
                break
            take += 1
        work, self._queued = self._queued[:take], self._queued[take:]
        return work

    async def _device_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queued:
                await self._device_step(self._take())

    async def _device_step(self, work: list[tuple[Any, float, asyncio.Future]]) -> None:
        """Run one device step and settle its futures. Whatever fails here fails this step's
        callers with the error (never leaves them waiting) and the loop goes on."""
        futures = [w[2] for w in work]
        try:
            results = await self._encode_and_publish(work)
        except Exception as exc:
            log.exception("encoding %d images failed", len(work))
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, result in zip(futures, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _encode_and_publish(self, work: list[tuple[Any, float, asyncio.Future]]) -> list:
        items = [w[0] for w in work]
        start = time.perf_counter()
        for _, arrived, _ in work:
            metrics.observe("stage_seconds", start - arrived, stage="queue_wait")
        forward = asyncio.get_running_loop().run_in_executor(
            self._device_pool, self._forward_and_encode, items
        )
        results, values, plan = await forward
        encoded = time.perf_counter()
        self._seconds["forward_and_encode"] += encoded - start
        metrics.observe("stage_seconds", encoded - start, stage="forward")
        self._record_forwards(items, plan)
        metrics.inc("images_encoded_total", len(items))
        try:
            with metrics.timed("store_round_trip_seconds", op="put"):
                await asyncio.to_thread(self.store.put_values, values)
            metrics.inc("bytes_published_total", sum(len(v) for _, v in values))
        except StoreError as exc:  # the embeddings are computed; the callers still get them
            metrics.inc("store_errors_total", op="put")
            log.warning("publishing %d embeddings failed: %s", len(values), exc)
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
        while True:
            try:
                await asyncio.to_thread(self._report_store)
            except Exception:  # a metrics fault must not end the reporting, nor anything else
                log.exception("reporting store stats failed")
            await asyncio.sleep(period_s)

    def _report_store(self) -> None:
        try:
            stats = self.store.stats()
        except StoreError:
            return
        metrics.set_gauge("cache_evictions", stats.get("evictions", 0)
                          + stats.get("local_evictions", 0))  # fmt: skip
