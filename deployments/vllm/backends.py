"""Which of the front's vLLM servers run vitserve's encoder-cache connector.

A vLLM server started without the connector (no ``--ec-transfer-config``) takes a chat's keyed
images as ones it never saw and encodes them itself: every image encoded twice, once by each
tier, and no error anywhere. So the front reads each server's ``/metrics`` (the connector's
``vllm:vitserve_ec_*`` counters are there from its start, at zero) when it first needs the
server and again every ``vllm.check_s``: a server restarted without the connector is found
out. (A connector pointed at another model's service refuses to start: its own model check.)

Invariants:

* One :class:`Backend` per server, only :class:`BackendChecks` moves it: ``UNCHECKED`` until
  its first read, then ``CONNECTED`` (the counters are there), ``NO_CONNECTOR`` (its
  ``/metrics`` answered without them) or ``UNREACHABLE`` (no answer: the chat path decides, as
  for any server it cannot reach).
* A server in ``NO_CONNECTOR`` takes no chat (:meth:`BackendChecks.takes_chats`); the front
  passes it over, and with none left refuses the chat naming why (:meth:`BackendChecks.refusal`).
* A read is due once per ``every_s`` per server, or once per ``retry_s`` (at most 1 s) while it
  is ``UNREACHABLE`` (a server starting is read again soon); concurrent chats that find it due
  share one read (the lock), never one each.
* Only a server's first read holds a chat up (:meth:`BackendChecks.refresh` with ``wait``
  off); later ones run beside the chats, so a server that went dark costs no chat its
  connect timeout. ``/healthz`` waits for every due read.
* ``/healthz`` reports every server's state by its index, never its URL.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vitserve.errors import ServiceUnavailableError

#: what the connector's counters are named on vLLM's /metrics (client/vllm.py)
CONNECTOR_METRIC_PREFIX = "vllm:vitserve_ec_"


class Backend(enum.Enum):
    UNCHECKED = "unchecked"
    CONNECTED = "connected"
    NO_CONNECTOR = "no_connector"
    UNREACHABLE = "unreachable"


def backend_of_metrics(status: int, text: str) -> Backend:
    """A server's state from its ``/metrics`` answer: the connector's counters, or not."""
    if status != 200:
        return Backend.UNREACHABLE
    if any(line.startswith(CONNECTOR_METRIC_PREFIX) for line in text.splitlines()):
        return Backend.CONNECTED
    return Backend.NO_CONNECTOR


@dataclass
class _Slot:
    state: Backend = Backend.UNCHECKED
    read_at: float | None = None  # when its last read ended (None: never)


class BackendChecks:
    """The servers' states (see the module): ``read(i)`` is the I/O, an awaitable of the
    server's state (its ``/metrics`` GET, by :func:`backend_of_metrics`)."""

    def __init__(
        self,
        count: int,
        read: Callable[[int], Awaitable[Backend]],
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = [_Slot() for _ in range(count)]
        self.read = read
        self.every_s = every_s
        self.retry_s = min(every_s, 1.0)
        self.clock = clock
        self._locks = [asyncio.Lock() for _ in range(count)]
        self._background: set[asyncio.Task[None]] = set()

    def due(self, i: int) -> bool:
        slot = self.slots[i]
        if slot.read_at is None:
            return True
        period = self.retry_s if slot.state is Backend.UNREACHABLE else self.every_s
        return self.clock() - slot.read_at >= period

    async def refresh(self, wait: bool = True) -> None:
        """Read every server whose read is due, side by side; without ``wait``, only the
        unchecked ones are waited for, the others read in the background."""
        now, later = [], []
        for i in range(len(self.slots)):
            if not self.due(i):
                continue
            if wait or self.slots[i].read_at is None:
                now.append(i)
            elif not self._locks[i].locked():  # else: being read already
                later.append(i)
        for i in later:
            task = asyncio.create_task(self._refresh_one(i))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        await asyncio.gather(*(self._refresh_one(i) for i in now))

    async def _refresh_one(self, i: int) -> None:
        async with self._locks[i]:
            if not self.due(i):  # another chat read it while this one waited
                return
            try:
                state = await self.read(i)
            except Exception:  # any failure to read is: no answer
                state = Backend.UNREACHABLE
            self.slots[i] = _Slot(state, self.clock())

    def takes_chats(self, i: int) -> bool:
        return self.slots[i].state is not Backend.NO_CONNECTOR

    def states(self) -> list[str]:
        return [slot.state.value for slot in self.slots]

    def refusal(self) -> ServiceUnavailableError | None:
        """The error a chat gets when no server may take it (every one without the
        connector), else None."""
        if any(self.takes_chats(i) for i in range(len(self.slots))):
            return None
        names = ", ".join(f"vLLM server {i}" for i in range(len(self.slots)))
        return ServiceUnavailableError(
            "vLLM",
            f"{names} run{'s' if len(self.slots) == 1 else ''} without vitserve's connector: "
            "each image would be encoded twice (by vitserve and by vLLM). Start vLLM with "
            "--ec-transfer-config naming VitserveECConnector (see the README's vLLM section)",
        )


__all__ = [
    "CONNECTOR_METRIC_PREFIX",
    "Backend",
    "BackendChecks",
    "backend_of_metrics",
]
