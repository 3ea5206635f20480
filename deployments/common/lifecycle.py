"""Graceful stop of the HTTP applications: drain, then answer what is left with 503.

Serve's own shutdown closes the HTTP proxy at once (requests in flight lose their connection)
and took 5-60 s here (its controller's shutdown timed out at 30 s). A local run
(``vitserve serve``, :mod:`vitserve.deployments.runner.local`) stops this way instead:

1. The driver calls :func:`drain_all`: one :class:`StopSignal` actor, created before the
   applications, wakes every HTTP ingress replica that watches it (each replica's
   :class:`Draining` middleware started a watcher at its ASGI lifespan start).
2. Each replica's :class:`DrainGate` then answers every new request 503
   (:class:`~vitserve.errors.ServiceUnavailableError`, ``Retry-After``, ``Connection: close``)
   and lets the requests in flight finish for up to ``grace_s``. Those still running at the
   deadline are answered 503 at once; their work goes on in the background (an encode that
   completes still publishes, and releases its claims) until the cluster stops.
3. The replicas report what they did; the driver stops Ray.

Invariants: every HTTP request a replica accepted is answered, with its own answer or with a
503 (a response whose body already started streaming is let finish: its status is sent), or
its client went away first (Serve cancels the request; its work is cancelled with it, never
left running uncounted);
a replica's gate only ever goes from open to stopping; where no :class:`StopSignal` runs
(the test session's cluster, a RayService) the middleware only counts requests in flight.
Nothing here is half-written in a store: every store writes a record in one atomic step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vitserve.cache.node import RAY_NAMESPACE
from vitserve.deployments.common.responses import error_response
from vitserve.errors import ServiceUnavailableError

log = logging.getLogger("ray.serve")  # lands in the replica's Serve log

#: the stop signal of a local run: one per Ray cluster, in vitserve's Ray namespace (the node
#: stores' namespace)
STOP_SIGNAL_NAME = "vitserve-stop"
#: after the cut, how long the answers of the cut requests get to leave the replica
SETTLE_S = 0.5


async def _wait_until(done: Callable[[], bool], changed: asyncio.Event, deadline: float) -> None:
    """Return once ``done()`` holds or the monotonic ``deadline`` has passed; ``changed`` is
    set by whoever changes what ``done`` reads."""
    while not done() and (left := deadline - time.monotonic()) > 0:
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), left)
        except asyncio.TimeoutError:
            return


class DrainGate:
    """The requests in flight of one replica process, and whether it still admits more."""

    def __init__(self) -> None:
        self.stopping = False
        self.inflight = 0
        self.finished = 0  # requests that ended with their own answer while draining
        self.refused = 0  # new requests answered 503 while stopping
        self.cut = 0  # requests answered 503 at the deadline
        self._changed: asyncio.Event | None = None
        self._cut: asyncio.Event | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._changed is None or self._cut is None:  # bound to the replica's loop on use
            self._changed, self._cut = asyncio.Event(), asyncio.Event()
        return self._changed, self._cut

    def _idle(self) -> bool:
        return self.inflight == 0

    def enter(self) -> None:
        self.inflight += 1

    def leave(self, *, cut: bool = False) -> None:
        self.inflight -= 1
        if cut:
            self.cut += 1
        elif self.stopping:
            self.finished += 1
        self._events()[0].set()

    async def cut_signal(self) -> None:
        """Returns once the drain's deadline passed (the requests left are to be cut)."""
        await self._events()[1].wait()

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Stop admitting; wait up to ``grace_s`` for the requests in flight to finish, then
        cut the rest (answered 503) and give their answers ``SETTLE_S`` to leave. Counts."""
        changed, cut = self._events()
        started = time.monotonic()
        self.stopping = True
        await _wait_until(self._idle, changed, started + max(0.0, grace_s))
        if self.inflight:
            cut.set()
            await _wait_until(self._idle, changed, time.monotonic() + SETTLE_S)
        return {
            "pid": os.getpid(),
            "finished": self.finished,
            "cut": self.cut,
            "refused": self.refused,
            "streaming": self.inflight,
            "seconds": round(time.monotonic() - started, 3),
        }


GATE = DrainGate()  # one per replica process (one HTTP ingress per replica)


async def _unavailable(scope: Scope, receive: Receive, send: Send, reason: str) -> None:
    exc = ServiceUnavailableError("vitserve", reason)
    await error_response(exc, {"Connection": "close"})(scope, receive, send)


class Draining:
    """ASGI middleware of an HTTP ingress: requests pass through :data:`GATE` (see the
    module); at the ASGI lifespan start it starts the replica's stop watcher."""

    def __init__(self, app: ASGIApp, gate: DrainGate | None = None) -> None:
        self.app = app
        self.gate = gate or GATE
        self._watcher: asyncio.Task | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            if self._watcher is None:
                self._watcher = asyncio.create_task(watch_for_stop(self.gate))
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gate = self.gate
        if gate.stopping:
            gate.refused += 1
            await _unavailable(scope, receive, send, "stopping: not taking new requests")
            return
        state = {"started": False, "cut": False}

        async def tracked(message: Message) -> None:
            if state["cut"]:
                return  # answered 503 already; the work's own answer is dropped
            state["started"] = state["started"] or message["type"] == "http.response.start"
            await send(message)

        gate.enter()
        work = asyncio.ensure_future(self.app(scope, receive, tracked))
        deadline = asyncio.ensure_future(gate.cut_signal())
        try:
            try:
                await asyncio.wait({work, deadline}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # Serve cancels a request whose client went away: so is its work (an encode
                # past its claims runs on by itself, counted by the encoder's admission).
                work.cancel()
                raise
            if work.done() or state["started"]:
                await work  # its answer (or a stream already under way) is the answer
                return
            state["cut"] = True
            _BACKGROUND.add(work)  # goes on until the cluster stops; its answer is dropped
            work.add_done_callback(_finish_background)
            await _unavailable(
                scope, receive, send, "stopping: the request did not finish within the stop's grace"
            )
        finally:
            deadline.cancel()
            gate.leave(cut=state["cut"])


_BACKGROUND: set[asyncio.Future] = set()


def _finish_background(task: asyncio.Future) -> None:
    _BACKGROUND.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("a request cut at stop failed afterwards: %r", task.exception())


# -- the stop signal -----------------------------------------------------------------------------
class StopSignal:
    """A small async Ray actor: replicas wait on it; the driver fires it and collects what
    each replica did (:func:`open_stop_signal` makes it)."""

    def __init__(self) -> None:
        self._fired: asyncio.Event | None = None
        self._reported: asyncio.Event | None = None
        self.grace_s = 0.0
        self.watchers: set[str] = set()
        self.reports: dict[str, dict[str, Any]] = {}

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._fired is None or self._reported is None:
            self._fired, self._reported = asyncio.Event(), asyncio.Event()
        return self._fired, self._reported

    async def wait(self, watcher: str) -> float:
        """Registers ``watcher``; returns the grace once the stop is fired."""
        self.watchers.add(watcher)
        fired, _ = self._events()
        await fired.wait()
        return self.grace_s

    async def fire(self, grace_s: float) -> int:
        """Start the stop; the number of watchers registered."""
        self.grace_s = grace_s
        self._events()[0].set()
        return len(self.watchers)

    async def report(self, watcher: str, stats: dict[str, Any]) -> None:
        self.reports[watcher] = stats
        self._events()[1].set()

    async def drained(self, timeout_s: float) -> dict[str, Any]:
        """Once every registered watcher reported (or ``timeout_s`` passed): the reports and
        the watchers that did not report."""
        _, reported = self._events()
        await _wait_until(
            lambda: set(self.reports) >= self.watchers, reported, time.monotonic() + timeout_s
        )
        return {"reports": dict(self.reports), "missing": sorted(self.watchers - set(self.reports))}


async def watch_for_stop(gate: DrainGate) -> None:
    """A replica's watcher: wait for this cluster's :class:`StopSignal` (if one runs), drain
    ``gate`` with its grace and report. Returns at once where no signal runs."""
    try:
        signal = await asyncio.to_thread(ray.get_actor, STOP_SIGNAL_NAME, namespace=RAY_NAMESPACE)
    except ValueError:  # no local run's signal in this cluster: nothing to watch
        return
    me = f"{os.getpid()}"
    try:
        grace_s = await signal.wait.remote(me)
        stats = await gate.drain(grace_s)
        await signal.report.remote(me, stats)
    except Exception as exc:  # the driver (and its signal) went away first
        log.info("stop watcher ended: %r", exc)


def open_stop_signal() -> Any:
    """The driver's side: create this cluster's :class:`StopSignal` (before the applications,
    so that every replica finds it); its handle."""
    actor = ray.remote(num_cpus=0)(StopSignal)
    return actor.options(
        name=STOP_SIGNAL_NAME, namespace=RAY_NAMESPACE, max_concurrency=1000
    ).remote()


def drain_all(signal: Any, grace_s: float) -> dict[str, Any]:
    """Fire ``signal`` and wait (about ``grace_s`` + ``SETTLE_S``, bounded) until every
    watching replica drained; their counts summed, with ``replicas`` and ``missing``."""
    ray.get(signal.fire.remote(grace_s), timeout=5)
    wait_s = grace_s + SETTLE_S + 1.0
    done = ray.get(signal.drained.remote(wait_s), timeout=wait_s + 2)
    total: dict[str, Any] = {"replicas": len(done["reports"]), "missing": len(done["missing"])}
    for stats in done["reports"].values():
        for name in ("finished", "cut", "refused", "streaming"):
            total[name] = total.get(name, 0) + stats[name]
    return total
