"""One device step: the device queue's ``run_step``, from prepared images to answers.

A step forwards its images on the device thread (one at a time, one thread of its own: see
``EncoderDeployment``), encodes each embedding into its record, and hands one publish per
namespace in the step (one, unless tenants share it) to the
:class:`~vitserve.deployments.encoder.publisher.Publisher`, which also releases their claims.

Invariants:

* A step answers once its publishes are handed over and the previous step's have ended; a step
  with an unclaimed image (its store failed the lookup) answers after its own publish too, and
  an image whose publish failed then says so (``published: false``).
* A failed forward releases the step's claims (off the path) and fails every caller of it.
* What the autoscaler and ``counters`` read (``running_patches``, ``steps``, ``forwards``,
  ``seconds``) is written on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vitserve.cache.base import EmbeddingStore
from vitserve.cache.codec import encode_record, read_header
from vitserve.deployments.common import metrics
from vitserve.deployments.encoder.device_queue import Work
from vitserve.deployments.encoder.flight_store import FlightStore
from vitserve.deployments.encoder.publisher import Publisher, Put
from vitserve.deployments.encoder.records import embedding_record
from vitserve.deployments.encoder.wire import EncodedItem, describe_header, unpublished
from vitserve.encoder.engine import EncoderEngine

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log


@dataclass(frozen=True, slots=True)
class Publish:
    """Where a queued image's embedding goes (the device queue carries it opaquely): the store
    of its namespace, and the claim its publish releases (``(key, token)``) or None."""

    store: EmbeddingStore
    release: tuple[str, str] | None


class DeviceStep:
    """The device steps of one replica (see the module)."""

    def __init__(
        self,
        engine: EncoderEngine,
        device_pool: ThreadPoolExecutor,
        flight_store: FlightStore,
    ) -> None:
        self.engine = engine
        self._device_pool = device_pool
        self._flight_store = flight_store
        self.seconds: defaultdict[str, float] = defaultdict(float)  # device-step time by phase
        self.publisher = Publisher(flight_store.release_later, self.seconds)
        self.forwards: deque[dict[str, Any]] = deque(maxlen=256)  # the latest forwards
        # the step on the device now, and the recent steps as (end, device seconds, patches)
        self.running_patches, self.running_since = 0, 0.0
        self.steps: deque[tuple[float, float, int]] = deque(maxlen=4096)

    async def __call__(self, work: list[Work]) -> list[EncodedItem]:
        """One step (module)."""
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
        self.running_patches = patches = sum(p.patches for p in items)
        self.running_since = start
        try:
            results, values, plan = await asyncio.get_running_loop().run_in_executor(
                self._device_pool, self._forward_and_encode, items
            )
        except Exception:
            log.exception("encoding %d images failed", len(items))
            for store, _, releases in groups.values():
                self._flight_store.release_later(store, releases)
            raise
        finally:
            self.running_patches = 0
        encoded = time.perf_counter()
        self.steps.append((encoded, encoded - start, patches))
        self.seconds["forward_and_encode"] += encoded - start
        metrics.observe("stage_seconds", encoded - start, stage="forward")
        self._record_forwards(items, plan)
        metrics.inc("images_encoded_total", len(items))
        puts = [
            Put(store, [values[i] for i in indices], releases)
            for store, indices, releases in groups.values()
        ]
        unclaimed = any(w.publish.release is None for w in work)
        failed = await self.publisher.publish(puts, encoded, wait=unclaimed)
        # what its caller cannot find in the store yet: said in the answer, so a client that
        # misses it after encoding it again is told the store failed, not that the record was
        # evicted (the publish is tried again in the background)
        for position, (_, indices, _) in enumerate(groups.values()):
            if position in failed:
                for i in indices:
                    results[i] = unpublished(results[i])
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
            self.forwards.append(
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


__all__ = ["DeviceStep", "Publish"]
