"""A new ingress replica whose first model lookup fails (the encoder is starting, or gone)
answers a retryable 503, not a 500, and asks again on the next request; concurrent first
requests share one lookup. The real ingress class, a stand-in encoder handle, a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from vitserve.encoder.work import Capacity, ResizeRule, Terms
from vitserve.errors import ServiceUnavailableError


class Answer:
    def __init__(self, make: Any) -> None:
        self.make = make

    def remote(self) -> Any:
        return asyncio.ensure_future(self.make())


class Encoder:
    """``describe`` and ``work_terms`` as a Serve handle answers them; ``up`` False: Ray's
    error for an actor that is not there; counts the calls."""

    def __init__(self) -> None:
        self.up = False
        self.calls = 0
        self.describe = Answer(self._describe)
        self.work_terms = Answer(self._terms)

    async def _describe(self) -> dict[str, Any]:
        self.calls += 1
        await asyncio.sleep(0.05)
        if not self.up:
            from ray.exceptions import ActorUnavailableError

            raise ActorUnavailableError("the encoder replica is starting", None)
        return {"model": "m", "fingerprint": "f" * 16}

    async def _terms(self) -> Terms:
        return Terms(ResizeRule(patch_size=14), Capacity(10, 10), row_bytes=4)


def test_a_failing_first_model_lookup_is_a_retryable_503(redis_url: str) -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.ingress import Ingress

    cfg = VitserveConfig.load({"store": redis_url, "namespace": "describe-test"})
    encoder = Encoder()
    cls = Ingress.func_or_class
    ingress = cls.__new__(cls)

    async def run() -> None:
        await cls.__init__(ingress, encoder, None, cfg.model_dump())  # Serve's async init
        with pytest.raises(ServiceUnavailableError) as down:
            await ingress._describe()
        assert down.value.http_status == 503 and down.value.retryable
        encoder.up = True
        calls = encoder.calls
        answers = await asyncio.gather(*(ingress._describe() for _ in range(5)))
        assert all(a["fingerprint"] == "f" * 16 for a in answers)
        assert encoder.calls == calls + 1  # asked again, once for the five
        assert (await ingress._work_terms()).row_bytes == 4

    asyncio.run(run())
