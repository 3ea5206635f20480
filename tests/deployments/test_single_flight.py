"""Single flight (``vitserve.deployments.encoder.single_flight``) alone: plain asyncio over the
in-process store, no Ray. Each test pins one clause of the module's rule or invariants.

What the old code did instead (issue 25): a BUSY image's wait ran ``store.wait_for`` in a thread
of the event loop's default executor (five threads in a one-CPU replica) while the publish it
waited for needed one too; and an image became joinable only after its request had prepared all
its images. The tests below run with a default executor of one thread that something else
holds, so any wait or release that took one of its threads would hang them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from vitserve.cache.base import Claim
from vitserve.cache.codec import encode_record
from vitserve.cache.memory import MemoryStore
from vitserve.cache.testing import make_record, new_key
from vitserve.deployments.encoder.single_flight import (
    POLL_MAX_S,
    ClaimState,
    Outcome,
    Role,
    SingleFlight,
)

WON, BUSY, UNCLAIMED = ClaimState.WON, ClaimState.BUSY, ClaimState.UNCLAIMED


def run(test: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``test`` on a new loop whose default executor has one thread, held by a blocking
    call for the whole test: nothing single flight does may need it."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(ThreadPoolExecutor(1))
    held = threading.Event()

    async def main() -> Any:
        blocker = loop.run_in_executor(None, held.wait, 30)
        try:
            return await asyncio.wait_for(test(), 20)
        finally:
            held.set()
            await blocker

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def publish(store: MemoryStore, key: str, rows: int = 3, release: Any = ()) -> None:
    """What the claimant's encoder does: store the value and release its claim, in one call."""
    record = make_record(rows=rows, key=key)
    store.put_values([(key, encode_record(record))], release=list(release))


def test_claim_states_cross_as_an_enum() -> None:
    assert ClaimState.of(Claim.WON) is WON and ClaimState.of(Claim.BUSY) is BUSY
    assert ClaimState.of(None) is UNCLAIMED


def test_an_image_is_joinable_from_the_moment_its_request_arrives() -> None:
    """The leader registers its flight before it prepares anything: a request that arrives
    while the leader still decodes joins it (even though the store says BUSY), and gets the
    leader's result; nothing else is encoded."""

    async def test() -> None:
        flights = SingleFlight()
        key = new_key()
        preparing = asyncio.Event()
        leader_roles = flights.roles([key], [WON])
        assert leader_roles == [Role.LEAD]
        [lead] = flights.begin([key], leader_roles).values()

        async def leader() -> None:
            await preparing.wait()  # decoding its (large) images
            flights.settle(lead, {"key": key, "from": "leader"})

        task = asyncio.create_task(leader())
        follower_roles = flights.roles([key], [BUSY])
        assert follower_roles == [Role.JOIN]  # not WAIT: the flight runs here already
        [joined] = flights.begin([key], follower_roles).values()
        assert joined is lead
        preparing.set()
        assert await flights.join(joined) == {"key": key, "from": "leader"}
        await task
        assert flights.flight(key) is None  # forgotten once settled

    run(test)


def test_a_key_twice_in_one_call_leads_once() -> None:
    async def test() -> None:
        flights = SingleFlight()
        key = new_key()
        assert flights.roles([key, key], [WON, WON]) == [Role.LEAD, Role.JOIN]

    run(test)


def test_a_waiter_whose_claimant_dies_takes_over_at_once() -> None:
    """The claimant gives up without publishing (its encoder call failed; the ingress releases
    the claim): the waiter learns it at the next poll, not at its timeout, claims the image and
    leads its encode."""

    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert store.claim(key, ttl_s=60, token="claimant")
        waiting = asyncio.create_task(flights.wait(store, key, timeout_s=30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        started = time.monotonic()
        store.release(key, token="claimant")
        waited = await waiting
        assert waited.outcome is Outcome.GONE
        assert time.monotonic() - started < 4 * POLL_MAX_S
        role, future, token = await flights.take_over(store, key, ttl_s=60)
        assert role is Role.LEAD and token == store.token
        assert flights.flight(key) is future
        assert not store.claim(key, ttl_s=1, token="someone else")  # ours now

    run(test)


def test_a_claim_that_expires_ends_the_wait() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert store.claim(key, ttl_s=0.3, token="claimant")  # its claimant hangs
        started = time.monotonic()
        waited = await flights.wait(store, key, timeout_s=30)
        assert waited.outcome is Outcome.GONE
        assert 0.25 < time.monotonic() - started < 0.3 + 4 * POLL_MAX_S

    run(test)


def test_a_wait_times_out_and_leaves_nothing_behind() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert store.claim(key, ttl_s=60, token="claimant")
        started = time.monotonic()
        assert (await flights.wait(store, key, timeout_s=0.2)).outcome is Outcome.TIMED_OUT
        assert time.monotonic() - started < 0.2 + 2 * POLL_MAX_S
        [poller] = flights._pollers.values()
        assert poller.waiters == {}
        await asyncio.sleep(2 * POLL_MAX_S)
        assert poller.task is not None and poller.task.done()  # no key left to poll

    run(test)


def test_many_waiters_and_one_publish() -> None:
    """Three hundred waiters on three keys cost one store call per poll (not one thread each);
    the publish goes through while they wait, and each waiter gets its key's header."""

    async def test() -> None:
        store = MemoryStore(namespace="sf")
        calls: list[str] = []
        flights = SingleFlight(hook=lambda event, **f: calls.append(f.get("op", event)))
        keys = [new_key() for _ in range(3)]
        for key in keys:
            assert store.claim(key, ttl_s=60, token="claimant")
        waits = [
            asyncio.create_task(flights.wait(store, keys[i % 3], timeout_s=30)) for i in range(300)
        ]
        # wait for the poller to have asked at least twice (not a fixed sleep: a loaded CI host
        # may start 300 tasks slower than the first tick)
        deadline = time.monotonic() + 10
        while calls.count("poll") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not any(w.done() for w in waits)
        polls_before = calls.count("poll")
        for key in keys:  # the claimant publishes, in single flight's own threads too
            await flights.call("put", publish, store, key, 3, [(key, "claimant")])
        results = await asyncio.gather(*waits)
        assert all(r.outcome is Outcome.PUBLISHED for r in results)
        assert all(
            r.header is not None and r.header.key == keys[i % 3] for i, r in enumerate(results)
        )
        # one poll a tick for all 300 waiters (the ticks back off): a few dozen at most, never 300
        assert polls_before >= 2 and calls.count("poll") < 60, calls.count("poll")

    run(test)


def test_a_cancelled_joiner_or_waiter_leaves_the_flight_and_the_others_alone() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key, other = new_key(), new_key()
        [lead] = flights.begin([key], flights.roles([key], [WON])).values()
        joiners = [asyncio.create_task(flights.join(lead)) for _ in range(3)]
        await asyncio.sleep(0)
        joiners[0].cancel()  # its client went away
        await asyncio.sleep(0)
        assert not lead.done() and flights.flight(key) is lead
        flights.settle(lead, "result")
        assert await asyncio.gather(*joiners[1:]) == ["result", "result"]
        # a waiter cancelled is dropped from the poller; another on the same key goes on
        assert store.claim(other, ttl_s=60, token="claimant")
        w1 = asyncio.create_task(flights.wait(store, other, timeout_s=30))
        w2 = asyncio.create_task(flights.wait(store, other, timeout_s=30))
        await asyncio.sleep(0.05)
        w1.cancel()
        await asyncio.sleep(0.05)
        publish(store, other, release=[(other, "claimant")])
        assert (await w2).outcome is Outcome.PUBLISHED
        with pytest.raises(asyncio.CancelledError):
            await w1
        [poller] = flights._pollers.values()
        assert poller.waiters == {}

    run(test)


def test_a_flight_follows_its_device_future_whatever_its_caller_does() -> None:
    """The leader's caller may be cancelled (its client went away): the flight still ends with
    the device work's result, or its error, for whoever joined."""

    async def test() -> None:
        flights = SingleFlight()
        ok, bad = new_key(), new_key()
        loop = asyncio.get_running_loop()
        leads = flights.begin([ok, bad], flights.roles([ok, bad], [WON, UNCLAIMED]))
        device = {k: loop.create_future() for k in (ok, bad)}
        for i, k in enumerate((ok, bad)):
            flights.follow(leads[i], device[k])

        async def caller() -> None:  # as EncoderDeployment.encode awaits its request's run
            await asyncio.shield(asyncio.gather(*device.values()))

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)
        task.cancel()
        device[ok].set_result("embedded")
        device[bad].set_exception(RuntimeError("the device step failed"))
        assert await flights.join(leads[0]) == "embedded"
        with pytest.raises(RuntimeError, match="device step failed"):
            await flights.join(leads[1])
        # a device future cancelled all the same: the joiners get an error, never a hang
        gone = new_key()
        [lead] = flights.begin([gone], [Role.LEAD]).values()
        source = loop.create_future()
        flights.follow(lead, source)
        source.cancel()
        with pytest.raises(RuntimeError, match="stopped"):
            await flights.join(lead)

    run(test)


def test_a_store_down_ends_the_wait_and_take_over_still_leads() -> None:
    from vitserve.errors import StoreUnavailableError

    class Down(MemoryStore):
        def lookup_states(self, keys: Any) -> Any:
            raise StoreUnavailableError("test", "down")

        def claim(self, key: str, ttl_s: float, token: str | None = None) -> bool:
            raise StoreUnavailableError("test", "down")

    async def test() -> None:
        store = Down(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert (await flights.wait(store, key, timeout_s=30)).outcome is Outcome.STORE_DOWN
        role, future, token = await flights.take_over(store, key, ttl_s=60)
        assert role is Role.LEAD and token is None  # encode it, unclaimed
        flights.settle(future, "x")

    run(test)


def test_take_over_joins_a_flight_started_during_the_wait() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert store.claim(key, ttl_s=0.2, token="claimant")
        waiting = asyncio.create_task(flights.wait(store, key, timeout_s=30))
        await asyncio.sleep(0.05)
        lead = flights.lead(key)  # a request encoding it arrived here meanwhile
        assert (await waiting).outcome is Outcome.GONE
        role, future, token = await flights.take_over(store, key, ttl_s=60)
        assert role is Role.JOIN and future is lead and token is None
        flights.settle(lead, "ok")

    run(test)


def test_releases_run_in_single_flights_own_threads() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        key = new_key()
        assert store.claim(key, ttl_s=60, token="t")
        flights.release_later(store, [(key, "t")])
        await flights.drain()
        assert store.claim(key, ttl_s=60, token="other")

    run(test)
