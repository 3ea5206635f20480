"""Open-loop load: requests arrive as a Poisson process at a set rate, whether or not earlier
ones have been answered.

Why asyncio + httpx, not locust: a locust user is a closed loop (it sends its next request
when its last one returns), so a locust run's arrival rate falls as the service slows down,
and the latency it measures hides the queue a real arrival process builds (coordinated
omission). Open loop needs each arrival to be its own request in flight, started at its
scheduled time. One asyncio task per arrival on one event loop does exactly that in a few
lines: the schedule is drawn up front (:func:`loadtest.harness.load.poisson_arrivals`), the loop
sleeps until each arrival, and the in-flight count is a plain integer, with no thread per
request and no pool of users to size. httpx's async client is the HTTP client the project
already uses (the SDK's); its connection pool is sized to the in-flight bound, so no request
waits inside the client for a connection.

Invariants:

* Every scheduled arrival yields exactly one :class:`~loadtest.harness.measures.Record`: a
  success, a failure (HTTP error, timeout, a cut at the drain deadline), or an *overflow* (the
  arrival found ``max_in_flight`` requests in flight and was not sent; error ``"overflow"``).
  Nothing is dropped silently.
* The request of each arrival is built whether or not it is sent, so the sequence of requests
  (and of duplicate images) is the same however fast the service answers.
* Latency is measured from the *scheduled* arrival, so a late send (the generator behind its
  schedule) counts against the latency, never hides it; each record's ``lag_s`` says how late
  it was sent.
* At most ``max_in_flight`` requests are in flight at any moment.

    python -m loadtest.harness.openloop     # configured by LOADTEST_CONF (see ``main``)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.harness.load import RunLength, poisson_arrivals
from loadtest.harness.measures import OVERFLOW, Record
from loadtest.harness.scenarios import (
    ImagePool,
    RandomMultimodal,
    Request,
    encode_error,
    encode_files,
)

__all__ = ["OpenLoopResult", "drive", "main"]


@dataclass
class OpenLoopResult:
    t0: float  # wall-clock start of the schedule (epoch s)
    records: list[Record]
    in_flight: list[tuple[float, int]] = field(default_factory=list)  # (t since t0, count)
    max_in_flight_seen: int = 0


async def drive(
    schedule: Sequence[float],
    build: Callable[[], Request],
    send: Callable[[Request], Awaitable[str | None]],
    *,
    max_in_flight: int,
    drain_timeout_s: float = 330.0,
    on_record: Callable[[Record], None] | None = None,
) -> OpenLoopResult:
    """Send ``build()`` at each offset of ``schedule`` (seconds from now) through ``send``
    (which returns an error string or ``None``), at most ``max_in_flight`` at a time."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    loop = asyncio.get_running_loop()
    mono0, t0 = loop.time(), time.time()
    result = OpenLoopResult(t0=t0, records=[])
    in_flight = 0
    tasks: set[asyncio.Task] = set()

    def record(rec: Record) -> None:
        result.records.append(rec)
        if on_record is not None:
            on_record(rec)

    def count(delta: int) -> None:
        nonlocal in_flight
        in_flight += delta
        result.max_in_flight_seen = max(result.max_in_flight_seen, in_flight)
        result.in_flight.append((loop.time() - mono0, in_flight))

    async def one(req: Request, due: float) -> None:
        sent = loop.time()
        error: str | None
        try:
            error = await send(req)
        except asyncio.CancelledError:
            error = f"cut: still in flight {drain_timeout_s:g} s after the last arrival"
        except Exception as exc:  # any failure of one request is that request's record
            error = f"{type(exc).__name__}: {exc}"[:200]
        record(
            Record(
                start=t0 + due,
                latency_s=loop.time() - (mono0 + due),
                ok=error is None,
                k=req.k,
                name=f"open k={req.k}",
                error=error,
                lag_s=sent - (mono0 + due),
            )
        )
        count(-1)

    for due in schedule:
        # (always yields, so the requests already started run even when the loop is late)
        await asyncio.sleep(max(0.0, mono0 + due - loop.time()))
        req = build()
        if in_flight >= max_in_flight:
            record(
                Record(
                    start=t0 + due,
                    latency_s=None,
                    ok=False,
                    k=req.k,
                    name=f"open k={req.k}",
                    error=OVERFLOW,
                )
            )
            continue
        count(+1)
        task = asyncio.create_task(one(req, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    return result


def encode_sender(client: httpx.AsyncClient) -> Callable[[Request], Awaitable[str | None]]:
    async def send(req: Request) -> str | None:
        try:
            answer = await client.post("/v1/encode", files=encode_files(req))
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
        try:
            payload = answer.json()
        except ValueError:
            payload = None
        return encode_error(answer.status_code, answer.text, payload, req.k)

    return send


async def _run(conf: dict[str, Any]) -> OpenLoopResult:
    rate = float(conf["rate"])
    length = RunLength(float(conf["min_s"]), int(conf.get("min_requests", 0)), float(conf["max_s"]))
    seed = int(conf.get("seed", 0))
    schedule = poisson_arrivals(rate, random.Random(seed), length)
    pool = ImagePool(per_size=2, seed=seed, run_id=conf.get("run_id", "run"))
    gen = RandomMultimodal(
        pool,
        int(conf.get("k_min", 1)),
        int(conf.get("k_max", 4)),
        duplicate_ratio=float(conf.get("duplicate_ratio", 0.3)),
        seed=seed,
    )
    for size in pool.sizes:  # the base images before the clock starts, not at an arrival
        pool.base(size)
    bound = int(conf.get("max_in_flight", 32))
    limits = httpx.Limits(max_connections=bound, max_keepalive_connections=bound)
    records_path = conf.get("records")
    out = open(records_path, "a") if records_path else None  # noqa: SIM115 (closed below)

    def write(rec: Record) -> None:
        if out is not None:
            out.write(rec.to_json() + "\n")
            out.flush()

    try:
        async with httpx.AsyncClient(
            base_url=conf["url"], timeout=float(conf.get("timeout_s", 300)), limits=limits
        ) as client:
            return await drive(
                schedule,
                gen.next_request,
                encode_sender(client),
                max_in_flight=bound,
                drain_timeout_s=float(conf.get("timeout_s", 300)) + 30,
                on_record=write,
            )
    finally:
        if out is not None:
            out.close()


def main() -> int:
    """Run one open-loop point from ``LOADTEST_CONF`` (JSON): ``url``, ``rate`` (requests/s),
    ``min_s``, ``min_requests``, ``max_s`` (the :class:`RunLength`), ``seed``, ``run_id``,
    ``k_min``, ``k_max``, ``duplicate_ratio``, ``max_in_flight``, ``timeout_s``, ``records``
    (the JSON-lines file each record is appended to as it ends) and ``meta`` (a JSON file:
    the schedule's start, the in-flight samples)."""
    conf = json.loads(os.environ["LOADTEST_CONF"])
    result = asyncio.run(_run(conf))
    if conf.get("meta"):
        step = max(1, len(result.in_flight) // 2000)  # enough for a plot
        Path(conf["meta"]).write_text(
            json.dumps(
                {
                    "t0": result.t0,
                    "max_in_flight": int(conf.get("max_in_flight", 32)),
                    "max_in_flight_seen": result.max_in_flight_seen,
                    "in_flight": result.in_flight[::step],
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
