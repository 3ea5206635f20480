"""The encoder replica's one batching layer: a queue between its callers and its device.

**The rule.** Callers (one per request; a request brings all its missing images at once) put
their images on the queue, in arrival order. One device task runs forwards one at a time. When
the device is free it takes the oldest queued image and, in arrival order, the queued images of
a like size (patches within ``max_size_ratio`` of the oldest's, either way), as many as fit in
``max_batch_patches`` (at least one: an image over the cap runs alone), and runs them as one
device step (the engine's planner splits a step into uniform-bucket forwards under its
activation budget). Every image of a step waits for the whole step, so a thumbnail never rides
in a large image's step (one that did came back with the large image, not after its own
short forward). The images passed over keep their order and the oldest always leads the next
step, so none is passed over forever.
Images that arrive while a step runs wait for the next one, so concurrent requests share
forwards as soon as there is a queue, and an image on an idle device never waits for company:
``batch_wait_timeout_s`` (default 0) is the most a free device waits after the first image for
more to arrive (it stops waiting early once the cap is full). With batching off, each step is
one image.

**Why our own queue, not ``@serve.batch``.** Measured on a 2-vCPU AMD EPYC, the previous design
(``@serve.batch`` gathering images into batches that this queue then re-merged, because Serve
runs a new batch only when the previous returns) against this queue alone, same model and
images (``loadtest/results/hot-path-cpu.md``): queue wait 59.6 ms mean before, 0.25-2.7 ms
after; one new 448px image 85.9 ms p50 before, 61-65 ms after. Serve's batching works per call
(here: per request, with a variable number of images), has no notion of "the device is busy",
and its ``max_batch_size`` must be set per replica from outside the decorator; one queue that
knows when the device is free states the whole rule in one place.

Admission (``vitserve.deployments.encoder.admission``) happens before an image reaches the
queue: what it holds is bounded by the replica's work budget, not by this class.

Invariants: every queued image's future is settled exactly once, with its result or with the
error of its step (a failing step fails its own images only, and the loop goes on), whether or
not its caller still awaits it; a step holds the oldest queued image, and no two of its images
differ in patches by more than ``max_size_ratio`` times the oldest's; the queue holds no state
outside its instance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Work:
    """One image waiting for the device: its prepared pixels, when it arrived, what the step
    needs to publish it (opaque here: the encoder's ``Publish``, its namespace's store and the
    claim the publish releases) and the future its caller awaits."""

    prepared: Any
    arrived: float
    publish: Any
    future: asyncio.Future = field(repr=False)


Step = Callable[[list[Work]], Awaitable[list[Any]]]

#: How far an image's patches may be from the step's oldest image's (either way) and share its
#: step: 448px and 224px images ride together, a 112px thumbnail and a 1344px image do not.
DEFAULT_MAX_SIZE_RATIO = 4.0


class DeviceQueue:
    """See the module docstring. ``run_step`` runs one device step and returns one result per
    image (the encoder's forward + publish); ``max_batch_patches`` None means no cap (GPUs)."""

    def __init__(
        self,
        run_step: Step,
        *,
        max_batch_patches: int | None,
        wait_s: float = 0.0,
        enabled: bool = True,
        max_size_ratio: float = DEFAULT_MAX_SIZE_RATIO,
    ) -> None:
        if max_size_ratio < 1.0:
            raise ValueError(f"max_size_ratio is at least 1, got {max_size_ratio}")
        self._run_step = run_step
        self.max_batch_patches = max_batch_patches
        self.max_size_ratio = max_size_ratio
        self.wait_s = wait_s
        self.enabled = enabled
        self._queued: list[Work] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def enqueue(self, prepared: Sequence[Any], publish: Sequence[Any]) -> list[asyncio.Future]:
        """Queue images (with what publishing each needs); the future of each, settled with its
        result or its step's error. The images run whether or not anyone awaits the futures
        (a caller that goes away leaves its images to finish and publish)."""
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        work = [
            Work(p, now, w, loop.create_future()) for p, w in zip(prepared, publish, strict=True)
        ]
        if not work:
            return []
        self._queued.extend(work)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())
        return [w.future for w in work]

    async def submit(self, prepared: Sequence[Any], publish: Sequence[Any]) -> list[Any]:
        """``enqueue``, then the results in order (an image's step error is raised here)."""
        return list(await asyncio.gather(*self.enqueue(prepared, publish)))

    def queued_patches(self) -> int:
        """Patches waiting for the device (not yet in a step)."""
        return sum(w.prepared.patches for w in self._queued)

    def _full(self) -> bool:
        cap = self.max_batch_patches
        return cap is not None and self.queued_patches() >= cap

    def _take(self) -> list[Work]:
        """The next step: the oldest queued image and the like-sized ones after it, in order,
        up to the patch cap (see the rule); the others stay queued, in order."""
        head, *rest = self._queued
        if not self.enabled:
            self._queued = rest
            return [head]
        cap, ratio = self.max_batch_patches, self.max_size_ratio
        size = max(head.prepared.patches, 1)
        work, left, patches = [head], [], head.prepared.patches
        for i, w in enumerate(rest):
            p = w.prepared.patches
            if not size / ratio <= max(p, 1) <= size * ratio:
                left.append(w)  # not like-sized: a later step
            elif cap is not None and patches + p > cap:
                left.extend(rest[i:])  # the step is full: the rest wait, in order
                break
            else:
                work.append(w)
                patches += p
        self._queued = left
        return work

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.enabled and self.wait_s > 0 and self._queued and not self._full():
                deadline = time.perf_counter() + self.wait_s
                while not self._full() and (left := deadline - time.perf_counter()) > 0:
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), left)
                    except asyncio.TimeoutError:
                        break
            while self._queued:
                await self._step(self._take())

    async def _step(self, work: list[Work]) -> None:
        """Run one step and settle its futures; whatever fails fails this step's images only."""
        try:
            results = await self._run_step(work)
        except Exception as exc:
            for w in work:
                if not w.future.done():
                    w.future.set_exception(exc)
            return
        for w, result in zip(work, results, strict=True):
            if not w.future.done():
                w.future.set_result(result)
