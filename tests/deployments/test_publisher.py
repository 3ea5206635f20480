"""The publisher (``vitserve.deployments.encoder.publisher``) alone: plain asyncio over the
in-process store, no Ray. Each test pins one clause of its rule or invariants."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from vitserve.cache.codec import encode_record
from vitserve.cache.memory import MemoryStore
from vitserve.deployments.encoder import publisher as publisher_module
from vitserve.deployments.encoder.publisher import Publisher, Put
from vitserve.errors import StoreUnavailableError
from vitserve.testing.records import make_record, new_key


class HeldStore(MemoryStore):
    """Puts wait for ``gate`` (a publish still landing); the first ``down`` puts fail as
    unavailable, and ``broken`` ones with another error."""

    def __init__(self, down: int = 0, broken: bool = False) -> None:
        super().__init__(namespace="pub")
        self.gate = threading.Event()
        self.gate.set()
        self.down, self.broken, self.tries = down, broken, 0

    def put_values(self, items: Any, ttl_s: float | None = None, release: Any = ()) -> None:
        self.tries += 1
        self.gate.wait(10)
        if self.broken:
            raise RuntimeError("the store broke")
        if self.down:
            self.down -= 1
            raise StoreUnavailableError("test", "failing over")
        super().put_values(items, ttl_s, release)


def _put(store: MemoryStore, claimed: bool = True) -> Put:
    key = new_key()
    if claimed:
        assert store.claim(key, ttl_s=60, token="t")
    return Put(
        store,
        [(key, bytes(encode_record(make_record(rows=2, key=key))))],
        [(key, "t")] if claimed else [],
    )


def _publisher(released: list) -> Publisher:
    return Publisher(lambda store, claims: released.extend(claims), {"publish": 0.0})


def test_a_claimed_step_answers_before_its_publish_lands_but_after_the_previous_one() -> None:
    async def test() -> None:
        store, released = HeldStore(), []
        pub = _publisher(released)
        store.gate.clear()  # the first step's publish is still landing
        first = _put(store)
        assert (
            await asyncio.wait_for(pub.publish([first], time.perf_counter(), wait=False), 5)
            == set()
        )
        second = asyncio.ensure_future(pub.publish([_put(store)], time.perf_counter(), wait=False))
        await asyncio.sleep(0.1)
        assert not second.done()  # it waits for the step before it
        store.gate.set()
        assert await asyncio.wait_for(second, 5) == set()
        await pub.drain()
        assert store.get(first.values[0][0]) is not None and released == []

    asyncio.run(test())


def test_an_unclaimed_step_waits_for_its_own_publish_and_hears_its_failure() -> None:
    async def test() -> None:
        store, released = HeldStore(broken=True), []
        pub = _publisher(released)
        put = _put(store)
        assert await pub.publish(
            [_put(MemoryStore(namespace="ok"), claimed=False), put], time.perf_counter(), wait=True
        ) == {1}
        assert released == put.releases  # a publish failed for good lets its readers go

    asyncio.run(test())


def test_a_publish_refused_as_unavailable_is_tried_again_with_its_claims_held(monkeypatch) -> None:
    monkeypatch.setattr(publisher_module, "PUBLISH_RETRY_S", (0.01, 0.01, 0.01))

    async def test() -> None:
        store, released = HeldStore(down=2), []
        pub = _publisher(released)
        put = _put(store)
        assert await pub.publish([put], time.perf_counter(), wait=True) == {0}  # said at once
        await pub.drain()
        assert store.tries == 3 and released == []  # landed on the third try, claims kept
        assert store.get(put.values[0][0]) is not None

        gone = HeldStore(down=10)
        lost = _put(gone)
        await pub.publish([lost], time.perf_counter(), wait=False)
        await pub.drain()
        assert gone.tries == 1 + 3 and released == lost.releases  # given up: claims released

    asyncio.run(test())


def test_stop_waits_for_the_puts_still_running_at_most_its_timeout() -> None:
    async def test() -> None:
        store = HeldStore()
        pub = _publisher([])
        store.gate.clear()
        await pub.publish([_put(store)], time.perf_counter(), wait=False)
        started = time.monotonic()
        await asyncio.to_thread(pub.stop, 0.2)
        assert 0.15 < time.monotonic() - started < 2
        store.gate.set()
        await pub.drain()

    asyncio.run(test())


@pytest.mark.parametrize("wait", [True, False])
def test_a_step_with_no_puts_costs_nothing(wait: bool) -> None:
    async def test() -> None:
        assert await _publisher([]).publish([], time.perf_counter(), wait=wait) == set()

    asyncio.run(test())
