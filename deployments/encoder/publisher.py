"""The publisher: a device step's records go to the store in the order the steps ran, off the
device loop and, for claimed images, off the answers' path.

**The rule.** Each step's publish (one store call per namespace in the step, that also releases
the step's claims) is handed to the publish thread before any of the step's answers leaves.
A step then waits for the previous step's publish, and for its own only when it holds an
unclaimed image (:meth:`Publisher.publish`'s ``wait``): until a publish releases a claim, a
reader that misses the key waits for it (the stores' rule, ``vitserve.cache.base``), so a
claimed image's answer need not wait for its record to land.

A publish the store refused as unavailable (a primary failing over, a restart) is tried again
after each of ``PUBLISH_RETRY_S``, on a thread of its own (off the answers' path, the device
loop's and the first publishes'), its claims held meanwhile so that readers wait for the record
instead of missing it: a store back within a few seconds loses nothing that was answered. Then
it is given up (logged, claims released), as is one refused while ``MAX_REPUBLISHING`` others
are being tried again (a long outage holds no more embeddings than that).

Invariants:

* At most one step's records are in flight past their answers (``drain`` and ``stop`` wait for
  them), plus those being tried again.
* A publish that failed for good releases its claims (off the path): readers waiting on them
  miss and encode again; a reader never waits past a claim's ttl.
* Each put's bytes are counted once, when it lands (``bytes_published_total``); each failed
  try once (``store_errors_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

from vitserve.cache.base import EmbeddingStore
from vitserve.deployments.common import metrics
from vitserve.errors import StoreError, StoreUnavailableError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

PUBLISH_RETRY_S = (0.5, 1.0, 2.0)
MAX_REPUBLISHING = 32

Release = Callable[[EmbeddingStore, Sequence[tuple[str, str]]], None]


@dataclass(frozen=True, slots=True)
class Put:
    """One namespace's share of a device step: its store, its records ``(key, value)``, and the
    claims ``(key, token)`` its publish releases."""

    store: EmbeddingStore
    values: list[tuple[str, bytes]]
    releases: list[tuple[str, str]]


class Publisher:
    """One replica's publishes (see the module); ``release_later`` lets claims go off the
    path; ``seconds`` gains each step's publish time under ``"publish"``."""

    def __init__(self, release_later: Release, seconds: MutableMapping[str, float]) -> None:
        self._release_later = release_later
        self._seconds = seconds
        # Publishes have a thread of their own: nothing else (single flight's polls, a slow
        # store call) can hold up the device loop's publish.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-publish")
        self._republish_pool = ThreadPoolExecutor(1, thread_name_prefix="vitserve-republish")
        # The latest step's publish: each step waits for the one before it, so only this one
        # can still run past its answers. Its puts, as the publish thread's futures, for stop().
        self._last: asyncio.Future | None = None
        self._last_puts: list[Future] = []
        self._republishing: set[asyncio.Task] = set()

    async def publish(self, puts: list[Put], encoded: float, *, wait: bool) -> set[int]:
        """Hand a step's ``puts`` to the publish thread now; then wait for the previous step's
        publish, and with ``wait`` for this one: the positions in ``puts`` that failed (empty
        without ``wait``). ``encoded``: when the step's records were ready (perf_counter)."""
        self._last_puts = [
            self._pool.submit(p.store.put_values, p.values, None, p.releases) for p in puts
        ]
        landing = [asyncio.wrap_future(f) for f in self._last_puts]
        publishing = asyncio.ensure_future(self._published(puts, landing, encoded))
        previous, self._last = self._last, publishing
        if previous is not None:
            await asyncio.shield(previous)
        return await asyncio.shield(publishing) if wait else set()

    async def _published(
        self, puts: list[Put], landing: list[asyncio.Future], encoded: float
    ) -> set[int]:
        """A step's publishes, awaited: counted and timed; the positions that failed. One the
        store refused as unavailable is tried again in the background (``_again``); one that
        failed otherwise is logged and its claims are released."""
        failed: set[int] = set()
        for position, (put, landed) in enumerate(zip(puts, landing, strict=True)):
            try:
                with metrics.timed("store_round_trip_seconds", op="put"):
                    await landed
                metrics.inc("bytes_published_total", sum(len(v) for _, v in put.values))
            except Exception as exc:
                failed.add(position)
                metrics.inc("store_errors_total", op="put")
                if (
                    isinstance(exc, StoreUnavailableError)
                    and len(self._republishing) < MAX_REPUBLISHING
                ):
                    log.warning("publishing embeddings failed, trying again: %s", exc)
                    self._again(put)
                    continue
                if isinstance(exc, StoreError):
                    log.warning("publishing embeddings failed: %s", exc)
                else:
                    log.exception("publishing embeddings failed")
                self._release_later(put.store, put.releases)
        published = time.perf_counter() - encoded
        self._seconds["publish"] += published
        metrics.observe("stage_seconds", published, stage="publish")
        return failed

    def _again(self, put: Put) -> None:
        """Try a publish the store refused as unavailable again after each of PUBLISH_RETRY_S
        (on the republish thread, in a task of its own: no step or answer waits for it), its
        claims held till it lands; then give it up and release them."""

        async def again() -> None:
            loop = asyncio.get_running_loop()
            failure: Exception | None = None
            for pause in PUBLISH_RETRY_S:
                await asyncio.sleep(pause)
                try:
                    await loop.run_in_executor(
                        self._republish_pool, put.store.put_values, put.values, None, put.releases
                    )
                except Exception as exc:
                    failure = exc
                    metrics.inc("store_errors_total", op="put")
                    if isinstance(exc, StoreUnavailableError):
                        continue
                    break
                metrics.inc("bytes_published_total", sum(len(v) for _, v in put.values))
                return
            log.warning("publishing embeddings failed, given up: %s", failure)
            self._release_later(put.store, put.releases)

        task = asyncio.create_task(again())
        self._republishing.add(task)
        task.add_done_callback(self._republishing.discard)

    async def drain(self) -> None:
        """Until the publishes handed over have ended: the latest step's (the only one that can
        still run) and those being tried again."""
        while self._last is not None and not self._last.done():
            await asyncio.shield(self._last)
        while self._republishing:
            await asyncio.gather(*list(self._republishing), return_exceptions=True)

    def stop(self, timeout_s: float) -> None:
        """From any thread (a replica stopping): let the puts still running end, for at most
        ``timeout_s`` (the publish thread runs them in order, after any before them)."""
        if self._last_puts:
            wait_all(self._last_puts, timeout=timeout_s)


__all__ = ["MAX_REPUBLISHING", "PUBLISH_RETRY_S", "Publisher", "Put"]
