"""The encoder replica's work budget (``vitserve.deployments.encoder.admission``) alone, and
the device queue's futures that outlive their caller."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitserve.deployments.encoder.admission import WorkBudget
from vitserve.deployments.encoder.device_queue import DeviceQueue
from vitserve.encoder.work import Capacity, ImageWork
from vitserve.errors import BackpressureError, LimitExceededError

CAP = Capacity(max_patches=1000, max_bytes=10_000)


def w(patches: int, prepared: int, decode: int = 0) -> ImageWork:
    return ImageWork(patches, prepared, decode)


def test_a_request_is_admitted_whole_or_refused_now() -> None:
    budget = WorkBudget(CAP)
    a = budget.take({0: w(400, 2000, 4000), 1: w(100, 500, 3000)}, decoding=True)
    assert (budget.patches, budget.nbytes) == (500, 2500 + 7000)  # decodings as if at once
    with pytest.raises(BackpressureError) as refused:  # fits alone, not now: 429
        budget.take({0: w(600, 100)}, decoding=False)
    assert refused.value.http_status == 429 and refused.value.retryable
    assert (budget.patches, budget.nbytes) == (500, 9500) and budget.refused == 1
    with pytest.raises(LimitExceededError) as too_big:  # never fits: 413 naming the limit
        budget.take({0: w(1001, 1)}, decoding=False)
    assert too_big.value.http_status == 413 and too_big.value.limit == "encoder_max_patches"
    with pytest.raises(LimitExceededError, match="encoder_max_bytes"):
        budget.take({0: w(1, 10, 5_000), 1: w(1, 10, 5_000)}, decoding=True)
    a.release_decode()  # the images are prepared: the decoding's bytes come back
    assert budget.nbytes == 2500
    a.release(0)  # image 0's device step ended
    a.release(0)  # once only
    assert (budget.patches, budget.nbytes) == (100, 500)
    a.close()
    a.close()
    assert (budget.patches, budget.nbytes) == (0, 0)


def test_a_late_decoding_is_admitted_or_refused_alone() -> None:
    budget = WorkBudget(CAP)
    budget.take({0: w(10, 9_000)}, decoding=False)
    with pytest.raises(BackpressureError):
        budget.take_decoding(2_000)
    extra = budget.take_decoding(1_000)
    assert budget.nbytes == 10_000
    extra.close()
    assert budget.nbytes == 9_000


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["take", "decode", "release", "close"]),
            st.integers(0, 5),
            st.integers(0, 600),
            st.integers(0, 6000),
            st.integers(0, 6000),
        ),
        max_size=60,
    )
)
def test_the_budget_never_passes_its_capacity_and_gives_back_what_it_took(ops) -> None:
    budget = WorkBudget(CAP)
    tickets = []
    for op, n, patches, prepared, decode in ops:
        if op == "take":
            works = {i: w(patches // (i + 1), prepared // (i + 1), decode) for i in range(n)}
            with contextlib.suppress(BackpressureError, LimitExceededError):
                caller = f"ingress-{n % 2}"
                tickets.append(budget.take(works, decoding=bool(decode % 2), caller=caller))
        elif tickets and op == "decode":
            tickets[n % len(tickets)].release_decode()
        elif tickets and op == "release":
            tickets[n % len(tickets)].release(n % 3)
        elif tickets and op == "close":
            tickets.pop(n % len(tickets)).close()
        assert 0 <= budget.patches <= CAP.max_patches and 0 <= budget.nbytes <= CAP.max_bytes
        held = [t.held for t in tickets]
        assert budget.patches == sum(p for p, _ in held)
        assert budget.nbytes == sum(b for _, b in held)
        assert sum(budget.by_caller.values()) == budget.patches  # split by caller, exactly
        assert all(v > 0 for v in budget.by_caller.values())
    for t in tickets:
        t.close()
    assert (budget.patches, budget.nbytes, budget.by_caller) == (0, 0, {})


def test_admitted_patches_are_split_by_the_caller_that_sent_them() -> None:
    budget = WorkBudget(CAP)
    a = budget.take({0: w(300, 10), 1: w(100, 10)}, decoding=False, caller="ingress-1")
    b = budget.take({0: w(50, 10)}, decoding=False, caller="ingress-2")
    assert budget.by_caller == {"ingress-1": 400, "ingress-2": 50}
    a.release(0)
    assert budget.by_caller == {"ingress-1": 100, "ingress-2": 50}
    b.close()
    a.close()
    assert budget.by_caller == {}


def test_queued_images_run_when_their_caller_goes_away() -> None:
    """The device queue's futures settle whether or not the caller still awaits them (a client
    that disconnects leaves its images to finish and publish, counted by admission until
    then)."""
    ran: list[list[int]] = []

    async def step(work: list) -> list:
        await asyncio.sleep(0.01)
        ran.append([x.prepared.patches for x in work])
        return [x.prepared.patches * 10 for x in work]

    class P:
        def __init__(self, patches: int) -> None:
            self.patches = patches

    async def test() -> None:
        queue = DeviceQueue(step, max_batch_patches=None)
        futures = queue.enqueue([P(1), P(2)], [None, None])

        async def caller() -> list:
            return await asyncio.shield(asyncio.gather(*futures))

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)
        task.cancel()
        assert await asyncio.gather(*futures) == [10, 20]
        assert queue.enqueue([], []) == []

    asyncio.run(test())
    assert ran == [[1, 2]]
