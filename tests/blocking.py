"""An AsyncEncoderClient driven from synchronous test code: the tests that run the same body
over both clients (``tests/client``, the auth and cross-tenant suites) share this one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from vitserve.client import AsyncEncoderClient


class Blocking:
    """An AsyncEncoderClient whose coroutines run to completion on one private event loop, so
    one test body drives both clients."""

    def __init__(self, client: AsyncEncoderClient) -> None:
        self.client = client
        self.core = client.core
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if name == "iter_chunks":
            return lambda *a, **k: self._drain(attr(*a, **k))
        if asyncio.iscoroutinefunction(attr):
            return lambda *a, **k: self.loop.run_until_complete(attr(*a, **k))
        return attr

    def _drain(self, chunks: Any) -> Iterator[Any]:
        while True:
            try:
                yield self.loop.run_until_complete(chunks.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
