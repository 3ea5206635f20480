"""Single flight's store side: waits on another claimant, take-over claims and claim releases,
in threads of their own.

**Waits hold no thread.** A waiter is a future. Each store with waiters has one poller task that
asks the store about all its awaited keys in one ``lookup_states`` call per tick (the value's
header, or whether the claim is still held). Every store call here (polls, claims, releases)
runs in a pool of ``STORE_THREADS`` threads that no publish uses: a thousand waiters cost one
call per tick, and the publish they wait for never waits for them. What each image does is
planned by :class:`~vitserve.deployments.encoder.single_flight.SingleFlight` (pure state).

Invariants:

* A wait ends within its timeout and one poll: ``PUBLISHED`` (with the header), ``GONE``,
  ``TIMED_OUT`` or ``STORE_DOWN``; a waiter cancelled leaves nothing behind in the poller.
* A claim handed here and not published is released by ``release_later``, off the answer's
  path, in one store call; a failed release is logged, never raised (the claim's ttl ends it).
* A store call's failure (``StoreError``) is counted through the hook (``store_call``) and
  raised to the caller, except a take-over's claim: that one leads unclaimed.

Plain asyncio over an :class:`~vitserve.cache.base.EmbeddingStore`: no Ray (unit-tested with
the in-process store, ``tests/deployments/test_single_flight.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vitserve.cache.base import EmbeddingStore, Pending
from vitserve.deployments.encoder.single_flight import (
    Outcome,
    SingleFlight,
    TakeOver,
    Waited,
)
from vitserve.errors import StoreError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

#: threads of single flight's store calls (polls, claims, releases): never a publish's
STORE_THREADS = 2
#: the poller's first delay between polls, doubled while nothing changes, up to the second
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.05


class FlightStore:
    """One process's single-flight store calls (see the module), for its ``flights``."""

    def __init__(self, flights: SingleFlight, *, threads: int = STORE_THREADS) -> None:
        self.flights = flights
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vitserve-flight")
        self._pollers: dict[int, _Poller] = {}  # id(store) -> its poller
        self._background: set[asyncio.Task] = set()

    async def wait(self, store: EmbeddingStore, key: str, timeout_s: float) -> Waited:
        """Wait for ``key``'s value in ``store`` while someone holds its claim."""
        self.flights.hook("join", scope="remote")
        poller = self._pollers.get(id(store))
        if poller is None or poller.store is not store:
            poller = self._pollers[id(store)] = _Poller(self, store)
        future = poller.add(key)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            return Waited(Outcome.TIMED_OUT)
        finally:
            poller.drop(key, future)

    async def take_over(
        self, store: EmbeddingStore, key: str, ttl_s: float
    ) -> tuple[TakeOver, str | None]:
        """``SingleFlight.take_over`` with the claim made in ``store`` for ``ttl_s``; the token
        the new flight's publish releases (None: unclaimed, or a join). A claim won for a
        flight that started meanwhile is released."""

        async def claim() -> bool:
            try:
                return bool(await self.call("claim", store.claim, key, ttl_s))
            except StoreError:
                return False

        took = await self.flights.take_over(key, claim)
        if took.release:
            self.release_later(store, [(key, store.token)])
        return took, store.token if took.claimed else None

    async def call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in this store side's own threads, timed (``store_call`` hook); a
        StoreError is counted and raised."""
        started = time.perf_counter()
        error = False
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except StoreError:
            error = True
            raise
        finally:
            self.flights.hook(
                "store_call", op=op, seconds=time.perf_counter() - started, error=error
            )

    def release_later(self, store: EmbeddingStore, releases: Sequence[tuple[str, str]]) -> None:
        """Release claims ``(key, token)`` off the answer's path (one store call for them)."""
        if not releases:
            return

        async def release() -> None:
            try:
                await self.call("release", store.put_values, [], None, list(releases))
            except StoreError as exc:
                log.warning("releasing %d claims failed: %s", len(releases), exc)

        task = asyncio.create_task(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        """Until the releases under way are done (tests, a clean stop)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)


class _Poller:
    """The waits on one store: one ``lookup_states`` call per tick for every awaited key."""

    def __init__(self, calls: FlightStore, store: EmbeddingStore) -> None:
        self.calls = calls
        self.store = store
        self.waiters: dict[str, set[asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    def add(self, key: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(key, set()).add(future)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        return future

    def drop(self, key: str, future: asyncio.Future) -> None:
        waiting = self.waiters.get(key)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self.waiters[key]

    def _settle(self, key: str, waited: Waited) -> None:
        for future in self.waiters.pop(key, ()):
            if not future.done():
                future.set_result(waited)

    async def _run(self) -> None:
        delay = POLL_FIRST_S
        while self.waiters:
            keys = list(self.waiters)
            try:
                answers = await self.calls.call("poll", self.store.lookup_states, keys)
            except StoreError:
                for key in keys:
                    self._settle(key, Waited(Outcome.STORE_DOWN))
                continue
            changed = False
            for key, answer in zip(keys, answers, strict=True):
                if answer is Pending.CLAIMED:
                    continue
                changed = True
                self._settle(
                    key,
                    Waited(Outcome.GONE)
                    if answer is Pending.FREE
                    else Waited(Outcome.PUBLISHED, answer),
                )
            if self.waiters:
                delay = POLL_FIRST_S if changed else min(2 * delay, POLL_MAX_S)
                await asyncio.sleep(delay)


__all__ = ["POLL_MAX_S", "STORE_THREADS", "FlightStore"]
