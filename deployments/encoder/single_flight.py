"""Single flight: each new image is encoded once, however many requests and replicas ask for it.

**The rule.** The ingress's ``lookup_or_claim`` gives each new image of a request a
:class:`ClaimState`: the request holds the store's claim on it (``WON``), someone else does
(``BUSY``), or the store could not say (``UNCLAIMED``). On the encoder replica, one
:class:`SingleFlight` per process decides each image's :class:`Role` as the request arrives,
before any pixel is decoded:

* an image with a flight on this replica **joins** it (one shared future);
* else a ``WON`` or ``UNCLAIMED`` image **leads**: its flight is registered at once, so a request
  that arrives while this one still decodes its images joins it;
* else (``BUSY``) it **waits** for the claimant (another replica, or a request not here yet) on
  the store. When the value appears it is read back; when the claim is gone without one (the
  claimant failed, or its claim expired), the wait times out or the store fails, the waiter
  claims the image and leads (or joins a flight started here meanwhile).

**Waits hold no thread.** A waiter is a future. Each store with waiters has one poller task that
asks the store about all its awaited keys in one ``lookup_states`` call per tick (the value's
header, or whether the claim is still held). Every store call of single flight (polls, claims,
releases) runs in its own pool of ``STORE_THREADS`` threads, which no publish uses: a thousand
waiters cost one call per tick, and the publish they wait for never waits for them.

Invariants:

* At most one flight per key; a flight's future is settled exactly once (``settle``, or the
  future it ``follow``s) and forgotten as it settles.
* A caller that stops waiting (cancelled: its client went away) never settles, cancels or
  forgets a flight: joiners await it shielded.
* A wait ends within its timeout and one poll: ``PUBLISHED`` (with the header), ``GONE``,
  ``TIMED_OUT`` or ``STORE_DOWN``; a waiter cancelled leaves nothing behind in the poller.
* A claim handed to this process and not published is released by ``release_later``, off the
  answer's path.

Plain asyncio over an :class:`~vitserve.cache.base.EmbeddingStore`: no Ray (unit-tested alone,
``tests/deployments/test_single_flight.py``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vitserve.cache.base import Claim, EmbeddingStore, Header, Pending
from vitserve.errors import StoreError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

#: threads of single flight's store calls (polls, claims, releases): never a publish's
STORE_THREADS = 2
#: the poller's first delay between polls, doubled while nothing changes, up to the second
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.05


class ClaimState(enum.Enum):
    """How the ingress's ``lookup_or_claim`` left a new image (crosses from the ingress to the
    encoder in ``EncodeBatch.claims``)."""

    WON = "won"  # the request's token holds the claim: its encode publishes and releases it
    BUSY = "busy"  # someone else's claim: wait for their publish
    UNCLAIMED = "unclaimed"  # the store failed: nobody's claim is known; encode, unclaimed

    @classmethod
    def of(cls, answer: Claim | None) -> ClaimState:
        """The state of a store answer (None: the store failed)."""
        if answer is None:
            return cls.UNCLAIMED
        return cls.WON if answer is Claim.WON else cls.BUSY


class Role(enum.Enum):
    """What one caller does for one image (see the module)."""

    LEAD = "lead"
    JOIN = "join"
    WAIT = "wait"


class Outcome(enum.Enum):
    """How a wait on another claimant ended."""

    PUBLISHED = "published"  # the value is in the store (``Waited.header``)
    GONE = "gone"  # the claim was released or expired without a value
    TIMED_OUT = "timed_out"
    STORE_DOWN = "store_down"


@dataclass(frozen=True, slots=True)
class Waited:
    outcome: Outcome
    header: Header | None = None


Hook = Callable[..., None]  # hook(event, **fields): "join" (scope), "store_call" (op, seconds,
# error): what the encoder turns into metrics


def _no_hook(event: str, **fields: Any) -> None:
    del event, fields


class SingleFlight:
    """One replica process's flights, waits and claim releases (see the module)."""

    def __init__(self, *, threads: int = STORE_THREADS, hook: Hook = _no_hook) -> None:
        self._flights: dict[str, asyncio.Future] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="vitserve-flight")
        self._pollers: dict[int, _Poller] = {}  # id(store) -> its poller
        self._background: set[asyncio.Task] = set()
        self._hook = hook

    # -- flights on this replica -----------------------------------------------------------------
    def roles(self, keys: Sequence[str], states: Sequence[ClaimState]) -> list[Role]:
        """Each image's role (nothing registered: see ``begin``). A key twice in one call leads
        once; its repeats join."""
        roles, leading = [], set()
        for key, state in zip(keys, states, strict=True):
            if key in self._flights or key in leading:
                roles.append(Role.JOIN)
            elif state is ClaimState.BUSY:
                roles.append(Role.WAIT)
            else:
                roles.append(Role.LEAD)
                leading.add(key)
        return roles

    def begin(self, keys: Sequence[str], roles: Sequence[Role]) -> dict[int, asyncio.Future]:
        """Register a flight for each leading key; per index, the future of the flight each
        leading or joining image follows. Call it in the event-loop turn ``roles`` was answered
        in (no await between), so the roles still hold."""
        futures: dict[int, asyncio.Future] = {}
        for i, (key, role) in enumerate(zip(keys, roles, strict=True)):
            if role is Role.LEAD:
                futures[i] = self.lead(key)
            elif role is Role.JOIN:
                futures[i] = self._flights[key]
                self._hook("join", scope="local")
        return futures

    def flight(self, key: str) -> asyncio.Future | None:
        """The flight of ``key`` on this replica, if one runs."""
        return self._flights.get(key)

    def lead(self, key: str) -> asyncio.Future:
        """Register a new flight of ``key`` (none may run); forgotten once settled."""
        if key in self._flights:
            raise RuntimeError(f"a flight of {key[:16]} runs already")
        future = asyncio.get_running_loop().create_future()
        self._flights[key] = future
        future.add_done_callback(lambda f: self._forget(key, f))
        return future

    def _forget(self, key: str, future: asyncio.Future) -> None:
        if self._flights.get(key) is future:
            del self._flights[key]

    @staticmethod
    def settle(
        future: asyncio.Future, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Settle a flight with ``result`` or ``error`` (nothing if it is settled already)."""
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
            future.exception()  # retrieved: joiners re-raise it, nobody else needs to
        else:
            future.set_result(result)

    def follow(self, future: asyncio.Future, source: asyncio.Future) -> None:
        """Settle the flight ``future`` as ``source`` (the device queue's future) settles."""

        def copy(done: asyncio.Future) -> None:
            if done.cancelled():
                self.settle(future, error=RuntimeError("the encode this image joined stopped"))
            elif done.exception() is not None:
                self.settle(future, error=done.exception())
            else:
                self.settle(future, done.result())

        source.add_done_callback(copy)

    @staticmethod
    async def join(future: asyncio.Future) -> Any:
        """The flight's result (its error raised); cancelling the caller leaves it running."""
        return await asyncio.shield(future)

    # -- waits on another claimant ------------------------------------------------------------
    async def wait(self, store: EmbeddingStore, key: str, timeout_s: float) -> Waited:
        """Wait for ``key``'s value in ``store`` while someone holds its claim (module)."""
        self._hook("join", scope="remote")
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
    ) -> tuple[Role, asyncio.Future, str | None]:
        """After a wait that saw no value: ``(JOIN, flight, None)`` if a flight of ``key``
        runs here (started meanwhile), else ``(LEAD, new flight, token)``: the image is
        claimed for ``ttl_s`` under the store's token (None if the claim went elsewhere or the
        store failed: encode it anyway, the worst is a second encode, never a wrong answer)."""
        future = self.flight(key)
        if future is not None:
            self._hook("join", scope="local")
            return Role.JOIN, future, None
        try:
            won = await self.call("claim", store.claim, key, ttl_s)
        except StoreError:
            won = False
        future = self.flight(key)
        if future is not None:  # started during the claim: ours is not needed
            if won:
                self.release_later(store, [(key, store.token)])
            self._hook("join", scope="local")
            return Role.JOIN, future, None
        return Role.LEAD, self.lead(key), store.token if won else None

    # -- store calls -----------------------------------------------------------------------------
    async def call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in single flight's own threads, timed (``store_call`` hook); a
        StoreError is counted and raised."""
        started = time.perf_counter()
        error = False
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except StoreError:
            error = True
            raise
        finally:
            self._hook("store_call", op=op, seconds=time.perf_counter() - started, error=error)

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

    def __init__(self, flights: SingleFlight, store: EmbeddingStore) -> None:
        self.flights = flights
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
                answers = await self.flights.call("poll", self.store.lookup_states, keys)
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


__all__ = ["POLL_MAX_S", "STORE_THREADS", "ClaimState", "Outcome", "Role", "SingleFlight", "Waited"]
