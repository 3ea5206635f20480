"""Single flight alone: its plan (``vitserve.deployments.encoder.single_flight``, pure state:
the tests of the plan use no store) and its store side (``flight_store``, over the in-process
store), no Ray. Each test pins one clause of a module's rule or invariants.

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
from vitserve.deployments.encoder.flight_store import POLL_MAX_S, FlightStore
from vitserve.deployments.encoder.single_flight import (
    ClaimState,
    Outcome,
    Role,
    SingleFlight,
)
from vitserve.testing.records import make_record, new_key

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
        leader = flights.plan([key], [WON], "leader")
        assert leader.roles == (Role.LEAD,)
        [lead] = leader.futures.values()

        async def leader() -> None:
            await preparing.wait()  # decoding its (large) images
            flights.settle(lead, {"key": key, "from": "leader"})

        task = asyncio.create_task(leader())
        follower = flights.plan([key], [BUSY], "follower")
        assert follower.roles == (Role.JOIN,)  # not WAIT: the flight runs here already
        [joined] = follower.futures.values()
        assert joined is lead and follower.releases == ()  # a BUSY claim is not its to release
        preparing.set()
        assert await flights.join(joined) == {"key": key, "from": "leader"}
        await task
        assert flights.flight(key) is None  # forgotten once settled

    run(test)


def test_a_key_twice_in_one_call_leads_once() -> None:
    async def test() -> None:
        flights = SingleFlight()
        key = new_key()
        plan = flights.plan([key, key], [WON, WON], "t")
        assert plan.roles == (Role.LEAD, Role.JOIN)
        assert plan.futures[0] is plan.futures[1]
        # the repeat's claim is the lead's own: released by its publish, never before
        assert plan.releases == ()

    run(test)


def test_a_waiter_whose_claimant_dies_takes_over_at_once() -> None:
    """The claimant gives up without publishing (its encoder call failed; the ingress releases
    the claim): the waiter learns it at the next poll, not at its timeout, claims the image and
    leads its encode."""

    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        side = FlightStore(flights)
        key = new_key()
        assert store.claim(key, ttl_s=60, token="claimant")
        waiting = asyncio.create_task(side.wait(store, key, timeout_s=30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        started = time.monotonic()
        store.release(key, token="claimant")
        waited = await waiting
        assert waited.outcome is Outcome.GONE
        assert time.monotonic() - started < 4 * POLL_MAX_S
        took, token = await side.take_over(store, key, ttl_s=60)
        role, future = took.role, took.future
        assert role is Role.LEAD and token == store.token
        assert flights.flight(key) is future
        assert not store.claim(key, ttl_s=1, token="someone else")  # ours now

    run(test)


def test_a_claim_that_expires_ends_the_wait() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        side = FlightStore(flights)
        key = new_key()
        assert store.claim(key, ttl_s=0.3, token="claimant")  # its claimant hangs
        started = time.monotonic()
        waited = await side.wait(store, key, timeout_s=30)
        assert waited.outcome is Outcome.GONE
        assert 0.25 < time.monotonic() - started < 0.3 + 4 * POLL_MAX_S

    run(test)


def test_a_wait_times_out_and_leaves_nothing_behind() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        side = FlightStore(flights)
        key = new_key()
        assert store.claim(key, ttl_s=60, token="claimant")
        started = time.monotonic()
        assert (await side.wait(store, key, timeout_s=0.2)).outcome is Outcome.TIMED_OUT
        assert time.monotonic() - started < 0.2 + 2 * POLL_MAX_S
        [poller] = side._pollers.values()
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
        side = FlightStore(flights)
        keys = [new_key() for _ in range(3)]
        for key in keys:
            assert store.claim(key, ttl_s=60, token="claimant")
        waits = [
            asyncio.create_task(side.wait(store, keys[i % 3], timeout_s=30)) for i in range(300)
        ]
        # wait for the poller to have asked at least twice (not a fixed sleep: a loaded CI host
        # may start 300 tasks slower than the first tick)
        deadline = time.monotonic() + 10
        while calls.count("poll") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not any(w.done() for w in waits)
        polls_before = calls.count("poll")
        for key in keys:  # the claimant publishes, in single flight's own threads too
            await side.call("put", publish, store, key, 3, [(key, "claimant")])
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
        side = FlightStore(flights)
        key, other = new_key(), new_key()
        [lead] = flights.plan([key], [WON], "t").futures.values()
        joiners = [asyncio.create_task(flights.join(lead)) for _ in range(3)]
        await asyncio.sleep(0)
        joiners[0].cancel()  # its client went away
        await asyncio.sleep(0)
        assert not lead.done() and flights.flight(key) is lead
        flights.settle(lead, "result")
        assert await asyncio.gather(*joiners[1:]) == ["result", "result"]
        # a waiter cancelled is dropped from the poller; another on the same key goes on
        assert store.claim(other, ttl_s=60, token="claimant")
        w1 = asyncio.create_task(side.wait(store, other, timeout_s=30))
        w2 = asyncio.create_task(side.wait(store, other, timeout_s=30))
        await asyncio.sleep(0.05)
        w1.cancel()
        await asyncio.sleep(0.05)
        publish(store, other, release=[(other, "claimant")])
        assert (await w2).outcome is Outcome.PUBLISHED
        with pytest.raises(asyncio.CancelledError):
            await w1
        [poller] = side._pollers.values()
        assert poller.waiters == {}

    run(test)


def test_a_flight_follows_its_device_future_whatever_its_caller_does() -> None:
    """The leader's caller may be cancelled (its client went away): the flight still ends with
    the device work's result, or its error, for whoever joined."""

    async def test() -> None:
        flights = SingleFlight()
        ok, bad = new_key(), new_key()
        loop = asyncio.get_running_loop()
        leads = flights.plan([ok, bad], [WON, UNCLAIMED], "t").futures
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
        [lead] = flights.plan([gone], [UNCLAIMED], None).futures.values()
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
        side = FlightStore(flights)
        key = new_key()
        assert (await side.wait(store, key, timeout_s=30)).outcome is Outcome.STORE_DOWN
        took, token = await side.take_over(store, key, ttl_s=60)
        role, future = took.role, took.future
        assert role is Role.LEAD and token is None  # encode it, unclaimed
        flights.settle(future, "x")

    run(test)


def test_take_over_joins_a_flight_started_during_the_wait() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        side = FlightStore(flights)
        key = new_key()
        assert store.claim(key, ttl_s=0.2, token="claimant")
        waiting = asyncio.create_task(side.wait(store, key, timeout_s=30))
        await asyncio.sleep(0.05)
        lead = flights.lead(key)  # a request encoding it arrived here meanwhile
        assert (await waiting).outcome is Outcome.GONE
        took, token = await side.take_over(store, key, ttl_s=60)
        role, future = took.role, took.future
        assert role is Role.JOIN and future is lead and token is None
        flights.settle(lead, "ok")

    run(test)


def test_releases_run_in_single_flights_own_threads() -> None:
    async def test() -> None:
        store = MemoryStore(namespace="sf")
        flights = SingleFlight()
        side = FlightStore(flights)
        key = new_key()
        assert store.claim(key, ttl_s=60, token="t")
        side.release_later(store, [(key, "t")])
        await side.drain()
        assert store.claim(key, ttl_s=60, token="other")

    run(test)


# -- the plan alone: no store, no thread -----------------------------------------------------------


def test_a_plan_releases_only_the_claims_its_own_token_won_on_joined_images() -> None:
    """The step the replica and the ingress both take: a request whose images join flights
    here releases the claims it won on them (the flight's claim covers the key), never a BUSY
    image's (another request's claim) and never one of a key it leads."""

    async def test() -> None:
        flights = SingleFlight()
        running, busy, new, unclaimed = (new_key() for _ in range(4))
        first = flights.plan([running, busy], [WON, WON], "first")
        plan = flights.plan([running, busy, new, unclaimed], [WON, BUSY, WON, UNCLAIMED], "second")
        assert plan.roles == (Role.JOIN, Role.JOIN, Role.LEAD, Role.LEAD)
        assert plan.releases == ((running, "second"),)
        assert plan.futures[0] is first.futures[0] and plan.futures[1] is first.futures[1]
        assert plan.indices(Role.LEAD) == [2, 3] and plan.indices(Role.WAIT) == []
        # a request that holds no token (its lookup failed) releases nothing
        assert flights.plan([running], [WON], None).releases == ()
        # a BUSY image with no flight here waits (on the store), registering nothing
        waiting = new_key()
        assert flights.plan([waiting], [BUSY], "third").roles == (Role.WAIT,)
        assert flights.flight(waiting) is None

    run(test)


def test_a_refused_plan_leaves_no_flight_behind() -> None:
    """The replica plans a request, then admission refuses it in the same turn: ``end`` settles
    its leads with the refusal and forgets them at once, so the next request leads (it would
    otherwise join a flight that never runs, or one already failed)."""

    async def test() -> None:
        flights = SingleFlight()
        key = new_key()
        refused = flights.plan([key], [WON], "refused")
        flights.end(refused, RuntimeError("no room"))
        assert flights.flight(key) is None  # no await in between: not left to a callback
        again = flights.plan([key], [WON], "again")
        assert again.roles == (Role.LEAD,)
        with pytest.raises(RuntimeError, match="no room"):
            await flights.join(refused.futures[0])
        flights.settle(again.futures[0], "ok")
        assert await flights.join(again.futures[0]) == "ok"

    run(test)


def test_end_settles_only_the_leads_still_open_and_their_joiners_hear_it() -> None:
    async def test() -> None:
        flights = SingleFlight()
        done, stuck = new_key(), new_key()
        plan = flights.plan([done, stuck], [WON, WON], "t")
        joiner = flights.plan([stuck], [BUSY], "other")
        flights.settle(plan.futures[0], "embedded")
        flights.end(plan, RuntimeError("the encode stopped early"))
        assert await flights.join(plan.futures[0]) == "embedded"
        with pytest.raises(RuntimeError, match="stopped early"):
            await flights.join(joiner.futures[0])

    run(test)


def test_take_over_races_are_decided_without_a_store() -> None:
    """After a wait that saw no value: a flight started here before the claim is joined (no
    claim made); one started during the claim is joined and the claim won is to be released;
    else the waiter leads, claimed or not as the claim went."""

    async def test() -> None:
        flights = SingleFlight()
        claims: list[str] = []

        def claim_of(key: str, won: bool, meanwhile: bool = False) -> Any:
            async def claim() -> bool:
                claims.append(key)
                await asyncio.sleep(0)  # the store call: other requests run meanwhile
                if meanwhile:
                    flights.plan([key], [UNCLAIMED], None)  # a request leading it arrived
                return won

            return claim

        before = new_key()
        [running] = flights.plan([before], [WON], "t").futures.values()
        took = await flights.take_over(before, claim_of(before, won=True))
        assert (took.role, took.future, took.release) == (Role.JOIN, running, False)
        assert claims == []  # no claim was made for a flight that runs here

        during = new_key()
        took = await flights.take_over(during, claim_of(during, won=True, meanwhile=True))
        assert took.role is Role.JOIN and took.future is flights.flight(during)
        assert took.release and not took.claimed  # ours is not needed: release it

        lost = new_key()
        took = await flights.take_over(lost, claim_of(lost, won=False, meanwhile=True))
        assert took.role is Role.JOIN and not took.release  # nothing of ours to release

        won, unclaimed = new_key(), new_key()
        took = await flights.take_over(won, claim_of(won, won=True))
        assert took.role is Role.LEAD and took.claimed and flights.flight(won) is took.future
        took = await flights.take_over(unclaimed, claim_of(unclaimed, won=False))
        assert took.role is Role.LEAD and not took.claimed  # encoded unclaimed, still one flight
        assert flights.plan([unclaimed], [BUSY], "late").roles == (Role.JOIN,)

    run(test)


def test_a_settled_flight_is_forgotten_and_the_key_leads_again() -> None:
    async def test() -> None:
        flights = SingleFlight()
        key = new_key()
        [failed] = flights.plan([key], [WON], "t").futures.values()
        flights.settle(failed, error=RuntimeError("device step failed"))
        await asyncio.sleep(0)  # its done callbacks
        assert flights.flight(key) is None
        assert flights.plan([key], [WON], "retry").roles == (Role.LEAD,)

    run(test)
