"""The vLLM front's connector check (``vitserve.deployments.vllm.backends``), alone: what a
server's ``/metrics`` says, when a read is due, that concurrent chats share one read, and which
servers take chats."""

from __future__ import annotations

import asyncio

import pytest

from vitserve.deployments.vllm.backends import (
    CONNECTOR_METRIC_PREFIX,
    Backend,
    BackendChecks,
    backend_of_metrics,
)
from vitserve.errors import ServiceUnavailableError

WITH = (
    "# HELP vllm:num_requests_running Number of requests\n"
    'vllm:num_requests_running{engine="0"} 0.0\n'
    f'{CONNECTOR_METRIC_PREFIX}loads_total{{engine="0",model_name="m"}} 0.0\n'
)
WITHOUT = 'vllm:num_requests_running{engine="0"} 0.0\n# vllm:vitserve_ec_ in a comment\n'


def test_a_servers_state_is_read_from_its_metrics() -> None:
    assert backend_of_metrics(200, WITH) is Backend.CONNECTED
    assert backend_of_metrics(200, WITHOUT) is Backend.NO_CONNECTOR
    assert backend_of_metrics(404, WITH) is Backend.UNREACHABLE
    assert backend_of_metrics(200, "") is Backend.NO_CONNECTOR


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reads_are_due_once_per_period_and_concurrent_chats_share_one() -> None:
    clock, states, reads = Clock(), [Backend.CONNECTED, Backend.NO_CONNECTOR], []

    async def read(i: int) -> Backend:
        reads.append(i)
        await asyncio.sleep(0.01)  # a chat arriving meanwhile waits for this read
        return states[i]

    checks = BackendChecks(2, read, every_s=10.0, clock=clock)

    async def run() -> None:
        assert checks.states() == ["unchecked", "unchecked"]
        assert checks.takes_chats(0) and checks.takes_chats(1)  # unchecked: not refused
        await asyncio.gather(*(checks.refresh() for _ in range(5)))
        assert sorted(reads) == [0, 1]  # one read each for five chats
        assert checks.states() == ["connected", "no_connector"]
        assert checks.takes_chats(0) and not checks.takes_chats(1)
        assert checks.refusal() is None
        clock.now = 9.9
        await checks.refresh()
        assert len(reads) == 2  # not due yet
        clock.now = 10.0
        states[:] = [Backend.NO_CONNECTOR, Backend.CONNECTED]  # both restarted, otherwise
        await checks.refresh()
        assert len(reads) == 4 and checks.states() == ["no_connector", "connected"]

    asyncio.run(run())


def test_with_no_server_running_the_connector_a_chat_is_refused_naming_why() -> None:
    async def read(i: int) -> Backend:
        if i == 1:
            raise OSError("refused")
        return Backend.NO_CONNECTOR

    checks = BackendChecks(2, read, every_s=1.0, clock=Clock())
    asyncio.run(checks.refresh())
    assert checks.states() == ["no_connector", "unreachable"]
    assert checks.refusal() is None  # the unreachable one may come back: the send decides
    only = BackendChecks(1, read, every_s=1.0, clock=Clock())
    asyncio.run(only.refresh())
    refusal = only.refusal()
    assert isinstance(refusal, ServiceUnavailableError) and refusal.http_status == 503
    assert "vLLM server 0 runs without vitserve's connector" in str(refusal)
    assert "--ec-transfer-config" in str(refusal)


@pytest.mark.parametrize("count", [1, 3])
def test_unchecked_servers_take_chats(count: int) -> None:
    async def read(i: int) -> Backend:
        return Backend.CONNECTED

    checks = BackendChecks(count, read, every_s=1.0)
    assert all(checks.takes_chats(i) for i in range(count)) and checks.refusal() is None


def test_only_the_first_read_holds_a_chat_up_and_an_unreachable_server_is_read_again_soon():
    clock, reads = Clock(), []
    states = [Backend.UNREACHABLE]
    release = None

    async def read(i: int) -> Backend:
        reads.append(clock.now)
        if release is not None:
            await release.wait()  # a server that went dark: the read hangs
        return states[i]

    checks = BackendChecks(1, read, every_s=30.0, clock=clock)

    async def run() -> None:
        nonlocal release
        await checks.refresh(wait=False)  # the first read: waited for
        assert checks.states() == ["unreachable"] and reads == [0.0]
        clock.now = 0.5
        await checks.refresh(wait=False)
        assert len(reads) == 1  # not yet: retry_s is 1 s
        clock.now = 1.0
        states[0] = Backend.NO_CONNECTOR
        release = asyncio.Event()
        await asyncio.wait_for(checks.refresh(wait=False), 1.0)  # not held up by the read
        await asyncio.sleep(0)
        assert len(reads) == 2 and checks.states() == ["unreachable"]
        await checks.refresh(wait=False)  # in flight already: no second read
        assert len(reads) == 2
        release.set()
        await asyncio.sleep(0.01)
        assert checks.states() == ["no_connector"] and checks.refusal() is not None

    asyncio.run(run())
