"""The open-loop generator: every arrival is one record, the in-flight bound turns arrivals into
overflow failures (counted, never dropped), latency counts from the scheduled arrival. No
server: ``send`` is a coroutine the test controls, or httpx over a mock transport."""

from __future__ import annotations

import asyncio

import httpx

from loadtest.harness.measures import OVERFLOW
from loadtest.harness.openloop import drive, encode_sender
from loadtest.harness.scenarios import Request


def request(k: int = 1) -> Request:
    return Request([b"x"] * k, [(1, 1)] * k, 0)


def test_arrivals_beyond_the_bound_are_overflow_failures() -> None:
    async def scenario() -> tuple:
        gate = asyncio.Event()

        async def send(req: Request) -> str | None:
            await gate.wait()
            return None

        ks = iter(range(1, 11))
        run = asyncio.create_task(
            drive([0.0] * 10, lambda: request(next(ks) % 4 + 1), send, max_in_flight=3)
        )
        await asyncio.sleep(0.05)  # every arrival has come; three are waiting on the gate
        gate.set()
        return await run

    result = asyncio.run(scenario())
    assert len(result.records) == 10  # one record per arrival
    sent = [r for r in result.records if r.error != OVERFLOW]
    overflow = [r for r in result.records if r.error == OVERFLOW]
    assert len(sent) == 3 and all(r.ok for r in sent)
    assert len(overflow) == 7 and not any(r.ok for r in overflow)
    assert all(r.latency_s is None for r in overflow)
    assert result.max_in_flight_seen == 3
    assert sorted(r.k for r in result.records) == sorted(i % 4 + 1 for i in range(1, 11))


def test_latency_counts_from_the_scheduled_arrival() -> None:
    async def send(req: Request) -> str | None:
        await asyncio.sleep(0.05)
        return None

    result = asyncio.run(drive([0.02, 0.04, 0.06], request, send, max_in_flight=8))
    starts = sorted(r.start - result.t0 for r in result.records)
    assert [round(s, 3) for s in starts] == [0.02, 0.04, 0.06]
    for r in result.records:
        assert r.ok and r.latency_s >= 0.05 and 0 <= r.lag_s < 0.05
    assert max(c for _, c in result.in_flight) >= 2  # arrivals did not wait for completions
    assert result.in_flight[-1][1] == 0


def test_failures_and_cuts_are_records_too() -> None:
    async def send(req: Request) -> str | None:
        if req.k == 2:
            raise ConnectionError("refused")
        if req.k == 3:
            await asyncio.sleep(60)  # still in flight at the drain deadline
        return "HTTP 500: boom" if req.k == 4 else None

    ks = iter([1, 2, 3, 4])
    result = asyncio.run(
        drive([0, 0, 0, 0], lambda: request(next(ks)), send, max_in_flight=8, drain_timeout_s=0.1)
    )
    by_k = {r.k: r for r in result.records}
    assert by_k[1].ok
    assert by_k[2].error == "ConnectionError: refused"
    assert by_k[3].error and by_k[3].error.startswith("cut:")
    assert by_k[4].error == "HTTP 500: boom"


def test_the_encode_sender_checks_the_answer() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        n = request.content.count(b'name="images"')
        if n == 3:
            return httpx.Response(503, text="busy")
        items = [{"key": "k"}] * n
        if n == 2:
            items = [{"key": "k"}, {"error": {"message": "bad image"}}]
        return httpx.Response(200, json={"items": items})

    async def scenario() -> list:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(base_url="http://svc", transport=transport) as client:
            send = encode_sender(client)
            return [await send(request(k)) for k in (1, 2, 3)]

    ok, bad_item, busy = asyncio.run(scenario())
    assert ok is None
    assert bad_item and "bad image" in bad_item
    assert busy == "HTTP 503: busy"
