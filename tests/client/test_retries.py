"""Retries and error translation, fast: httpx's MockTransport stands in for the service (the
same behaviour against a real service is in test_client.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from vitserve.client import AsyncEncoderClient, EncoderClient, RetryPolicy
from vitserve.errors import (
    ApiError,
    BackpressureError,
    LimitExceededError,
    ServiceUnavailableError,
    VitserveError,
)

HEALTH = {"status": "ok", "fingerprint": "f" * 64, "namespace": "", "limits": {}}
FAST = RetryPolicy(attempts=3, backoff_s=0.001, max_backoff_s=0.002)


def _error(
    status: int, type_: str, headers: dict[str, str] | None = None, **fields
) -> httpx.Response:
    body = {"error": {"type": type_, "message": f"{type_} says no", **fields}}
    return httpx.Response(status, json=body, headers=headers)


def run(flavor: str, handler: Callable[[httpx.Request], httpx.Response], policy=FAST):
    """``describe()`` then ``probe([key])`` through a client whose HTTP goes to ``handler``."""
    transport = httpx.MockTransport(handler)
    if flavor == "sync":
        client = EncoderClient("http://svc", retry=policy)
        client.transport.client = httpx.Client(base_url="http://svc", transport=transport)
        with client:
            return client.probe(["a" * 64])

    async def main():
        client = AsyncEncoderClient("http://svc", retry=policy)
        client.transport.client = httpx.AsyncClient(base_url="http://svc", transport=transport)
        async with client:
            return await client.probe(["a" * 64])

    return asyncio.run(main())


def service(*probe_answers: httpx.Response | Exception) -> tuple[Callable, list[float]]:
    """A handler answering /healthz, then each probe with the next answer; the probe times."""
    answers = list(probe_answers)
    times: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            return httpx.Response(200, json=HEALTH)
        times.append(time.monotonic())
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handler, times


FLAVORS = pytest.mark.parametrize("flavor", ["sync", "async"])


@FLAVORS
def test_429_is_retried_after_its_retry_after(flavor: str) -> None:
    ok = httpx.Response(200, json={"exists": [False], "items": [None]})
    handler, times = service(
        _error(429, "BackpressureError", {"Retry-After": "0.2"}, queued=9, limit=8), ok
    )
    assert run(flavor, handler) == [None]
    assert len(times) == 2 and times[1] - times[0] >= 0.19


@FLAVORS
def test_a_dropped_connection_is_retried_then_reported(flavor: str) -> None:
    ok = httpx.Response(200, json={"exists": [False], "items": [None]})
    handler, times = service(httpx.ReadError("connection reset by peer"), ok)
    assert run(flavor, handler) == [None]
    handler, times = service(*[httpx.ConnectError("connection refused")] * 3)
    with pytest.raises(ServiceUnavailableError) as caught:
        run(flavor, handler)
    assert len(times) == 3 and caught.value.retryable and "refused" in str(caught.value)


@FLAVORS
def test_what_a_retry_cannot_help_is_raised_at_once_as_its_own_class(flavor: str) -> None:
    handler, times = service(
        _error(413, "LimitExceededError", limit="max_keys_per_probe", value=9, allowed=8)
    )
    with pytest.raises(LimitExceededError) as caught:
        run(flavor, handler)
    assert len(times) == 1
    assert (caught.value.limit, caught.value.value, caught.value.allowed) == (
        "max_keys_per_probe",
        9,
        8,
    )


@FLAVORS
def test_retryable_answers_that_persist_raise_their_error(flavor: str) -> None:
    handler, times = service(*[_error(429, "BackpressureError", queued=9, limit=8)] * 3)
    with pytest.raises(BackpressureError):
        run(flavor, handler)
    assert len(times) == 3


@FLAVORS
def test_answers_that_are_not_vitserve_errors_become_api_errors(flavor: str) -> None:
    handler, _ = service(httpx.Response(502, text="<html>bad gateway</html>"))
    with pytest.raises(ApiError) as caught:
        run(flavor, handler)
    assert caught.value.http_status == 502 and isinstance(caught.value, VitserveError)
    handler, _ = service(_error(418, "TeapotError"))
    with pytest.raises(ApiError, match="TeapotError"):
        run(flavor, handler)


def test_backoff_grows_and_retry_after_is_capped() -> None:
    policy = RetryPolicy(attempts=5, backoff_s=0.1, max_backoff_s=0.3, max_retry_after_s=2)
    assert [0.05 <= policy.delay(0) <= 0.1, 0.1 <= policy.delay(1) <= 0.2] == [True, True]
    assert 0.15 <= policy.delay(4) <= 0.3
    assert policy.delay(0, retry_after=60) == 2


def _drive(flow_ops: list, outcomes: list, policy: RetryPolicy = FAST) -> tuple[list, object]:
    """Drive ``core.retried`` over a flow that yields ``flow_ops`` (returning what it was sent
    last), answering each try with the next of ``outcomes``: what it yielded, and its value."""
    from vitserve.client.core import Sleep, retried

    def flow():
        got = None
        for op in flow_ops:
            got = yield op
        return got

    seen: list = []
    steps = retried(flow(), policy)
    try:
        step = next(steps)
        while True:
            seen.append(step)
            step = steps.send(None if isinstance(step, Sleep) else outcomes.pop(0))
    except StopIteration as done:
        return seen, done.value


def test_the_retry_loop_is_one_sans_io_generator() -> None:
    """Both clients drive ``core.retried``: a retryable failure is tried again after a sleep
    until its tries are spent; what a retry cannot help is raised at once; a store call with a
    fallback hands its failure to the flow; a 503 answer that persists comes back as it is."""
    from vitserve.client.core import ApiCall, Reply, Sleep, StoreCall

    call = ApiCall("probe", {"keys": []})
    down = ServiceUnavailableError("encoder", "restarting")
    seen, value = _drive([call], [down, "answer"])
    assert seen[0] == call and isinstance(seen[1], Sleep) and seen[2] == call
    assert value == "answer"
    with pytest.raises(ServiceUnavailableError):
        _drive([call], [down, down, down])  # FAST: three tries
    with pytest.raises(LimitExceededError):
        _drive([call], [LimitExceededError("pixels", 10, 5)])
    fallback = StoreCall("get_many", ((),), fallback=True)
    seen, value = _drive([fallback], [down])
    assert seen == [fallback] and value is down  # the core reads elsewhere: no retry, no raise
    busy = Reply(503, {})
    seen, value = _drive([call], [busy, busy, busy])
    assert value is busy and [type(s) for s in seen] == [ApiCall, Sleep] * 2 + [ApiCall]
