"""The encoder replica's device queue (``deployments/encoder/device_queue.py``): which queued
images share a step, and that every future is settled. Fast: no Ray, no model (a step that
records what it was given)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitserve.deployments.encoder.device_queue import DEFAULT_MAX_SIZE_RATIO, DeviceQueue


@dataclass(frozen=True)
class Image:
    name: str
    patches: int


def run(images: list[Image], **kwargs: object) -> list[list[str]]:
    """Queue ``images`` while the device is busy with a first image, then let it run; the
    steps after the first, by name."""
    steps: list[list[str]] = []
    gate = asyncio.Event()

    async def step(work: list) -> list[str]:
        steps.append([w.prepared.name for w in work])
        if len(steps) == 1:
            await gate.wait()  # the device is busy while the rest is queued
        return [w.prepared.name for w in work]

    async def main() -> None:
        queue = DeviceQueue(step, **kwargs)  # type: ignore[arg-type]
        first = queue.enqueue([Image("busy", 1)], [None])
        await asyncio.sleep(0)
        futures = [f for im in images for f in queue.enqueue([im], [None])]
        gate.set()
        results = await asyncio.gather(*first, *futures)
        assert results == ["busy", *(im.name for im in images)]  # each its own result

    asyncio.run(main())
    return steps[1:]


def test_a_thumbnail_never_shares_a_large_images_step() -> None:
    thumb, large, thumb2 = Image("thumb", 64), Image("large", 2048), Image("thumb2", 64)
    # the thumbnails queued around the large image ride together, before it
    assert run([thumb, large, thumb2], max_batch_patches=None) == [["thumb", "thumb2"], ["large"]]
    # the oldest leads: a large image queued first runs first, alone
    assert run([large, thumb, thumb2], max_batch_patches=None) == [["large"], ["thumb", "thumb2"]]


def test_like_sized_images_share_a_step_up_to_the_cap_in_arrival_order() -> None:
    a, b, c, d = (Image(n, p) for n, p in (("a", 256), ("b", 1024), ("c", 100), ("d", 256)))
    # b is 4x a: like-sized; c is 2.56x below a: like-sized; d fits no more under the cap
    assert run([a, b, c, d], max_batch_patches=1400) == [["a", "b", "c"], ["d"]]
    # the cap stops the step at the first like-sized image that does not fit, keeping order
    assert run([a, b, d, c], max_batch_patches=1300) == [["a", "b"], ["d", "c"]]


def test_a_ratio_of_infinity_batches_by_arrival_alone_and_batching_off_runs_one_by_one() -> None:
    images = [Image("t", 64), Image("l", 2048), Image("t2", 64)]
    assert run(images, max_batch_patches=None, max_size_ratio=float("inf")) == [["t", "l", "t2"]]
    assert run(images, max_batch_patches=None, enabled=False) == [["t"], ["l"], ["t2"]]


def test_the_ratio_is_at_least_one() -> None:
    async def step(work: list) -> list:
        return work

    with pytest.raises(ValueError, match="max_size_ratio"):
        DeviceQueue(step, max_batch_patches=None, max_size_ratio=0.5)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 20_000), min_size=1, max_size=12),
    cap=st.one_of(st.none(), st.integers(1, 30_000)),
)
def test_every_step_is_led_by_the_oldest_and_stays_like_sized(
    sizes: list[int], cap: int | None
) -> None:
    images = [Image(f"i{n}", p) for n, p in enumerate(sizes)]
    steps = run(images, max_batch_patches=cap)
    by_name = {im.name: im for im in images}
    order = [im.name for im in images]
    assert sorted(n for s in steps for n in s) == sorted(order)  # each image once
    done: set[str] = set()
    for names in steps:
        assert names[0] == next(n for n in order if n not in done)  # the oldest left leads
        lo, hi = (
            by_name[names[0]].patches * f
            for f in (1 / DEFAULT_MAX_SIZE_RATIO, DEFAULT_MAX_SIZE_RATIO)
        )
        assert all(lo <= by_name[n].patches <= hi for n in names)
        assert [order.index(n) for n in names] == sorted(order.index(n) for n in names)
        if cap is not None and len(names) > 1:
            assert sum(by_name[n].patches for n in names) <= cap
        done.update(names)
