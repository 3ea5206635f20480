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
* What it runs per call is :class:`~vitserve.deployments.encoder.pipeline.EncodePipeline`
  (its docstring states the rule), in named parts: the flight plan (single flight,
  :mod:`~vitserve.deployments.encoder.single_flight`), admission, preparing, the device queue
  (:mod:`~vitserve.deployments.encoder.device_queue`) and its steps, and the publisher
  (:mod:`~vitserve.deployments.encoder.publisher`). This class is the Serve shell: it builds them,
  answers Serve's hooks (autoscaling and routing stats) and the queries, and waits for the
  publishes when Serve stops it.
* So a new image costs two store round trips (the ingress's lookup-or-claim and the publish),
  and this replica makes none before its forward; a claimed image's answer does not wait for
  its publish (readers wait on the claim instead), so its path holds one.
* Namespaces (tenants, see ``vitserve.deployments.common.auth``): each batch names the namespace its
  images are keyed in; claims, waits and the publish go to that namespace's store over this
  replica's one store connection (a device step that mixes namespaces publishes once per
  namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch
from ray import serve

from vitserve.cache import open_connection
from vitserve.cache.base import EmbeddingStore
from vitserve.cache.views import StoreViews
from vitserve.deployments.common import metrics
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.encoder import autoscaling, routing
from vitserve.deployments.encoder.pipeline import EncodePipeline
from vitserve.deployments.encoder.preprocessing import make_preprocessor
from vitserve.deployments.encoder.wire import EncodeBatch, EncodedItem, ErrorItem
from vitserve.encoder.device import available_cpus, dtype_name
from vitserve.encoder.engine import EncoderEngine
from vitserve.encoder.work import Terms
from vitserve.errors import ConfigError, StoreError, StoreSplitError
from vitserve.media import VideoFor

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log


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
        # What this replica admits (from the activation budget unless configured), and how an
        # image's cost is read from its header (the ingress gets the same terms: ``terms``).
        self.terms = self.engine.terms(
            max_image_pixels=cfg.limits.max_image_pixels,
            max_patches=cfg.admission.max_patches,
            max_bytes=cfg.admission.max_bytes,
        )
        self.pipeline = EncodePipeline(
            self.engine,
            device_pool=self._device_pool,
            preprocessor=self.preprocessor,
            cpu_pool=self._cpu_pool,
            terms=self.terms,
            single_flight=cfg.single_flight,
            batching=cfg.batching,
        )
        self._store_reporter: asyncio.Task | None = None
        self._evictions = metrics.RunningCount()  # the store's count, as increments
        self._stopping = False  # set when Serve stops the replica (``__del__``)

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
        c, budget, step = self.engine.counters, self.pipeline.budget, self.pipeline.step
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "forward_calls": c.forward_calls,
            "images": c.images,
            "patches": c.patches,
            "oversize": c.oversize,
            "admitted": {
                "patches": budget.patches,
                "bytes": budget.nbytes,
                "refused": budget.refused,
            },
            "recent_forwards": list(step.forwards),
            "seconds": dict(step.seconds),
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
        now, step, admitted = time.perf_counter(), self.pipeline.step, self.pipeline.calls
        while step.steps and step.steps[0][0] < now - autoscaling.STATS_WINDOW_S:
            step.steps.popleft()
        while admitted and admitted[0][0] < now - autoscaling.STATS_WINDOW_S:
            admitted.popleft()
        calls = sum(p for _, p in admitted) / len(admitted) if admitted else 0.0
        done = sum(p for _, _, p in step.steps)
        rate_busy = sum(s for _, s, _ in step.steps)  # the finished steps' device time
        busy = rate_busy + (now - step.running_since if step.running_patches else 0.0)
        return {
            autoscaling.QUEUED_PATCHES: float(self.pipeline.queue.queued_patches()),
            autoscaling.RUNNING_PATCHES: float(step.running_patches),
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
        budget = self.pipeline.budget
        return {
            routing.ADMITTED_PATCHES: budget.patches,
            routing.BY_CALLER: dict(budget.by_caller),
            routing.ROOM_PATCHES: max(1, budget.capacity.max_patches // 2),
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
        if batch.claims_at is not None and batch.claims_at.split_from(store.connection.claim_scope):
            raise StoreSplitError(str(store.connection.claim_scope), str(batch.claims_at.scope))
        results = await self.pipeline.encode(batch, prepared, store)
        metrics.observe("encode_latency_seconds", time.perf_counter() - started)
        return results

    def _store_for(self, namespace: str | None) -> EmbeddingStore:
        """The store of a batch's namespace (None: the config's), over this replica's one
        connection: ``self.store`` for the config's, a tenant's otherwise."""
        namespace = self.cfg.namespace if namespace is None else namespace
        return self.store if namespace == self.store.namespace else self._views.get(namespace)

    async def drain_publishes(self) -> None:
        """Wait until the claim releases and publishes handed over have ended (tests)."""
        await self.pipeline.flight_store.drain()
        await self.pipeline.step.publisher.drain()

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
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None:
            pipeline.step.publisher.stop(self.cfg.single_flight.claim_ttl_s)
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
