"""Single flight's plan: each new image is encoded once, however many requests ask for it.

**The rule.** The ingress's ``lookup_or_claim`` gives each new image of a request a
:class:`ClaimState`: the request holds the store's claim on it (``WON``), someone else does
(``BUSY``), or the store could not say (``UNCLAIMED``). One :class:`SingleFlight` per process
(the ingress's encode flow, each encoder replica) plans each request as it arrives, before any
pixel is decoded (:meth:`SingleFlight.plan`, a :class:`FlightPlan`):

* an image with a flight in this process **joins** it (one shared future); a claim the request
  won on it is released (the flight's own claim covers the key);
* else a ``WON`` or ``UNCLAIMED`` image **leads**: its flight is registered at once, so a request
  that arrives while this one still decodes its images joins it;
* else (``BUSY``) it **waits** for the claimant (another process, or a request not here yet) on
  the store (:class:`~vitserve.deployments.encoder.flight_store.FlightStore`). When the claim is
  gone without a value, the waiter **takes over** (:meth:`SingleFlight.take_over`): it joins a
  flight started here meanwhile, else claims the image and leads.

This module is pure bookkeeping: no store, no thread, no I/O (the store calls are
``flight_store``'s; a take-over's claim is a coroutine handed in). Its unit tests need neither
Ray nor a store (``tests/deployments/test_single_flight.py``).

Invariants:

* At most one flight per key; a flight's future is settled exactly once (``settle``, the
  future it ``follow``s, or ``end``) and forgotten as it settles.
* A plan registers its leads in the call that answers it (no await inside): a request planned
  after it joins them. A key twice in one request leads once; its repeats join.
* A plan's ``releases`` are the claims its own token won on images that join: never a claim of
  another request's token, never a BUSY image's.
* A caller that stops waiting (cancelled: its client went away) never settles, cancels or
  forgets a flight: joiners await it shielded.
* ``end`` settles every lead of a plan still open (with the error given): a request that failed
  or stopped early leaves no joiner waiting.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vitserve.cache.base import Claim, Header


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


@dataclass(frozen=True, slots=True)
class FlightPlan:
    """One request's plan (:meth:`SingleFlight.plan`): per image its role; per leading or
    joining image the flight it follows; the claims to release (``(key, token)``: won by
    images that join)."""

    keys: tuple[str, ...]
    roles: tuple[Role, ...]
    futures: Mapping[int, asyncio.Future]
    releases: tuple[tuple[str, str], ...]

    def indices(self, role: Role) -> list[int]:
        """The positions of the images of ``role``, in order."""
        return [i for i, r in enumerate(self.roles) if r is role]

    def joining(self, i: int) -> bool:
        return self.roles[i] is Role.JOIN


@dataclass(frozen=True, slots=True)
class TakeOver:
    """After a wait that saw no value: lead (``future`` a new flight; ``claimed``: under the
    store's token, else unclaimed) or join (``future`` the flight that started meanwhile);
    ``release``: a claim won but not needed (a flight started during the claim)."""

    role: Role
    future: asyncio.Future
    claimed: bool = False
    release: bool = False


Hook = Callable[..., None]  # hook(event, **fields): "join" (scope), "store_call" (op, seconds,
# error): what the encoder turns into metrics


def _no_hook(event: str, **fields: Any) -> None:
    del event, fields


class SingleFlight:
    """One process's flights (see the module): pure state, driven from one event loop."""

    def __init__(self, *, hook: Hook = _no_hook) -> None:
        self._flights: dict[str, asyncio.Future] = {}
        self.hook = hook

    def plan(
        self, keys: Sequence[str], states: Sequence[ClaimState], token: str | None
    ) -> FlightPlan:
        """Each image's role, its leads registered at once (module); ``token`` the request's
        claim token (None: it holds none)."""
        roles: list[Role] = []
        futures: dict[int, asyncio.Future] = {}
        releases: list[tuple[str, str]] = []
        leading: set[str] = set()
        for i, (key, state) in enumerate(zip(keys, states, strict=True)):
            running = self._flights.get(key)
            if running is not None:
                roles.append(Role.JOIN)
                futures[i] = running
                self.hook("join", scope="local")
                # a won claim is released, unless it is the claim of a flight this plan leads
                # (a key twice in one request: its publish releases it)
                if state is ClaimState.WON and token is not None and key not in leading:
                    releases.append((key, token))
            elif state is ClaimState.BUSY:
                roles.append(Role.WAIT)
            else:
                roles.append(Role.LEAD)
                futures[i] = self.lead(key)
                leading.add(key)
        return FlightPlan(tuple(keys), tuple(roles), futures, tuple(releases))

    def end(self, plan: FlightPlan, error: BaseException) -> None:
        """Settle each lead of ``plan`` still open with ``error`` (a request that failed,
        was refused or stopped early)."""
        for i in plan.indices(Role.LEAD):
            self.settle(plan.futures[i], error=error)
            self._forget(plan.keys[i], plan.futures[i])  # now, not at its callback: a plan
            # made before the callback runs leads anew instead of joining a refused flight

    def flight(self, key: str) -> asyncio.Future | None:
        """The flight of ``key`` in this process, if one runs."""
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

    async def take_over(self, key: str, claim: Callable[[], Awaitable[bool]]) -> TakeOver:
        """After a wait on another claimant that saw no value: join a flight of ``key`` started
        here meanwhile, else ``claim()`` it (False: claimed elsewhere, or the store failed:
        encode it anyway, the worst is a second encode, never a wrong answer) and lead, unless
        a flight started during the claim (join it; the claim, if won, is to be released)."""
        running, won = self.flight(key), False
        if running is None:
            won = await claim()
            running = self.flight(key)
            if running is None:
                return TakeOver(Role.LEAD, self.lead(key), claimed=won)
        self.hook("join", scope="local")
        return TakeOver(Role.JOIN, running, release=won)


__all__ = [
    "ClaimState",
    "FlightPlan",
    "Outcome",
    "Role",
    "SingleFlight",
    "TakeOver",
    "Waited",
]
