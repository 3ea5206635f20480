"""The encode pipeline of one encoder replica: a request's missing images to their answers.

``EncoderDeployment`` is the Serve shell; this is what it runs per call, in named parts:

* the **flight plan** (:class:`~vitserve.deployments.encoder.single_flight.SingleFlight`):
  each image leads, joins a flight of this replica, or waits for another claimant (on the store:
  :class:`~vitserve.deployments.encoder.flight_store.FlightStore`), decided in the event-loop
  turn the request arrives in, before any pixel is decoded;
* **admission** (:class:`~vitserve.deployments.encoder.admission.WorkBudget`): the images it may
  encode are admitted by their patches and bytes, read from their headers, in that same turn,
  or the request is refused at once (429; 413 if it could never fit);
* **preparing** (decode, resize, patchify) in the replica's CPU threads when the images come as
  bytes; a bad image fails alone (its item carries the error);
* the **device queue** (:class:`~vitserve.deployments.encoder.device_queue.DeviceQueue`) and its
  steps (:class:`~vitserve.deployments.encoder.device_step.DeviceStep`), which forward and hand
  the records to the publisher.

Invariants:

* Once admitted, a request runs as a task of its own: a caller that goes away leaves it to
  finish and publish, still counted by admission, and every flight it leads is settled at its
  end, whatever happens.
* A claim the request won and will not publish (a joined image, a refused one, a failed
  decode) is released off the path; a waited image whose claimant gave up is encoded here,
  joining a flight of this replica if one started meanwhile.
* An image's admitted work is given back when its device future settles (or at once when it
  never reaches the queue); the request's ticket closes at its end.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vitserve.cache.base import EmbeddingStore
from vitserve.deployments.common import metrics
from vitserve.deployments.common.config import BatchingConfig, SingleFlightConfig
from vitserve.deployments.encoder.admission import Ticket, WorkBudget, image_work
from vitserve.deployments.encoder.device_queue import DeviceQueue
from vitserve.deployments.encoder.device_step import DeviceStep, Publish
from vitserve.deployments.encoder.flight_store import FlightStore
from vitserve.deployments.encoder.preprocessing import prepare_all
from vitserve.deployments.encoder.single_flight import ClaimState, FlightPlan, Role, SingleFlight
from vitserve.deployments.encoder.wire import (
    EncodeBatch,
    EncodedItem,
    ErrorItem,
    describe_header,
    error_item,
    is_error,
)
from vitserve.encoder.engine import EncoderEngine
from vitserve.encoder.work import ImageWork, Terms
from vitserve.errors import VitserveError


def _release_on_done(ticket: Ticket, i: int, _: asyncio.Future) -> None:
    """A queued image's done callback: its admitted work is given back."""
    ticket.release(i)


class EncodePipeline:
    """One replica's encode path (see the module)."""

    def __init__(
        self,
        engine: EncoderEngine,
        *,
        device_pool: ThreadPoolExecutor,
        preprocessor: Any,
        cpu_pool: ThreadPoolExecutor | None,
        terms: Terms,
        single_flight: SingleFlightConfig,
        batching: BatchingConfig,
    ) -> None:
        self.preprocessor = preprocessor
        self._cpu_pool = cpu_pool
        self.terms = terms
        self._sf = single_flight
        self.budget = WorkBudget(terms.capacity)
        self.flights = SingleFlight(hook=metrics.flight_hook("encoder"))
        self.flight_store = FlightStore(self.flights)
        self.step = DeviceStep(engine, device_pool, self.flight_store)
        # One cap for the queue's steps and the engine's forwards (config, else the engine's).
        self.queue = DeviceQueue(
            self.step,
            max_batch_patches=engine.max_batch_patches,
            wait_s=batching.batch_wait_timeout_s,
            enabled=batching.enabled,
        )
        self.calls: deque[tuple[float, int]] = deque(maxlen=4096)  # (admitted, patches)

    async def encode(
        self, batch: EncodeBatch, prepared: list[Any] | None, store: EmbeddingStore
    ) -> list[EncodedItem | ErrorItem]:
        """One request's missing images (keyed in ``store``'s namespace) -> one result (or
        error item) per image, in order: planned and admitted in the event-loop turn it arrives
        in, then run as a task of its own (module)."""
        plan = self.flights.plan(batch.keys, batch.claims, batch.token)
        # the cost of each image this request may encode here (a joined one costs nothing)
        works = self._works(
            batch, prepared, [i for i, r in enumerate(plan.roles) if r is not Role.JOIN]
        )
        try:
            ticket = self.budget.take(works, decoding=prepared is None, caller=batch.caller)
            self.calls.append((time.perf_counter(), sum(w.patches for w in works.values())))
        except VitserveError as exc:
            self.flights.end(plan, exc)  # nobody joined them: planned in this very turn
            metrics.inc("admission_refused_total", limit=type(exc).__name__)
            raise
        run = asyncio.create_task(self._run(batch, prepared, store, plan, works, ticket))
        return await asyncio.shield(run)

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

    async def _run(
        self,
        batch: EncodeBatch,
        prepared: list[Any] | None,
        store: EmbeddingStore,
        plan: FlightPlan,
        works: dict[int, ImageWork],
        ticket: Ticket,
    ) -> list[Any]:
        """The admitted request: lead, wait, join; the ticket closed and every flight it leads
        settled at the end, whatever happens."""
        results: list[Any] = [None] * len(batch.keys)
        self.flight_store.release_later(store, plan.releases)
        tasks = [self._lead(batch, prepared, store, plan, results, ticket)]
        tasks += [
            self._wait(batch, prepared, store, i, works[i], results, ticket)
            for i in plan.indices(Role.WAIT)
        ]
        try:
            done = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [e for e in done if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
            for i in plan.indices(Role.JOIN):
                results[i] = await self.flights.join(plan.futures[i])
        finally:
            ticket.close()
            # settled by now unless something failed before their step
            self.flights.end(plan, RuntimeError("the encode stopped early"))
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
        futures: Mapping[int, asyncio.Future],
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
        self.flight_store.release_later(store, releases)
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
        plan: FlightPlan,
        results: list[Any],
        ticket: Ticket,
    ) -> None:
        """The images this request encodes: prepared, queued, their results."""
        leads = plan.indices(Role.LEAD)
        ready = await self._prepare(batch, prepared, leads)
        ticket.release_decode()
        items = [
            (i, p, batch.token if batch.claims[i] is ClaimState.WON else None)
            for i, p in zip(leads, ready, strict=True)
        ]
        queued = self._queue(batch, store, items, plan.futures, results, ticket)
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
        waited = await self.flight_store.wait(store, key, self._sf.wait_timeout_s)
        if waited.header is not None:
            ticket.release(i)
            results[i] = describe_header(waited.header)
            return
        took, token = await self.flight_store.take_over(store, key, self._sf.claim_ttl_s)
        if took.role is Role.JOIN:
            ticket.release(i)
            results[i] = await self.flights.join(took.future)
            return
        future = took.future
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
                self.flight_store.release_later(store, [(key, token)])
        finally:
            self.flights.settle(future, error=RuntimeError("the encode stopped early"))


__all__ = ["EncodePipeline"]
