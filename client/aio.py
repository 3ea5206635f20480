"""``AsyncEncoderClient``: the asyncio client, on the same core as ``EncoderClient``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vitserve.cache.codec import EmbeddingRecord
from vitserve.client.base import ClientBase
from vitserve.client.chunks import chunk_bounds, item_spans
from vitserve.client.core import ApiCall, Flow, Sleep, retried
from vitserve.client.device import to_device
from vitserve.client.handles import FetchedChunk, ImageHandle, Submitted
from vitserve.client.inputs import ImageInput
from vitserve.client.transports import (
    AsyncHandleTransport,
    AsyncHttpTransport,
)
from vitserve.errors import VitserveError
from vitserve.media import VideoFor


class AsyncEncoderClient(ClientBase[AsyncHttpTransport, AsyncHandleTransport]):
    """The asyncio twin of :class:`~vitserve.client.sync.EncoderClient` (same arguments, same
    operations, awaited). Direct store reads run in worker threads."""

    http_transport = AsyncHttpTransport
    handle_transport = AsyncHandleTransport

    async def encode(
        self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL
    ) -> list[ImageHandle]:
        return await self._run(self.core.encode(images, video_for))

    async def submit(
        self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL
    ) -> list[Submitted]:
        """As :meth:`encode`, answered once the new images are claimed, before their
        embeddings are published (a new one is pending: :class:`Submitted`)."""
        return await self._run(self.core.submit(images, video_for))

    async def probe(self, keys: Sequence[str]) -> list[ImageHandle | None]:
        return await self._run(self.core.probe(keys))

    async def fetch(self, handles: Sequence[ImageHandle]) -> list[EmbeddingRecord]:
        return await self._run(self.core.fetch(handles))

    async def fetch_chunk(
        self,
        handles: Sequence[ImageHandle],
        offsets: Sequence[int | Sequence[int]],
        start: int,
        end: int,
        device: Any = None,
    ) -> FetchedChunk:
        chunk = await self._run(self.core.fetch_chunk(handles, offsets, start, end))
        return to_device(chunk, handles, device) if device is not None else chunk

    async def iter_chunks(
        self,
        handles: Sequence[ImageHandle],
        offsets: Sequence[int | Sequence[int]],
        length: int,
        chunk_size: int,
        device: Any = None,
        prefetch: bool = True,
        keep_whole: bool = False,
    ) -> AsyncIterator[FetchedChunk]:
        """As ``EncoderClient.iter_chunks``; the next chunk's read is a task running while the
        caller works on the current one."""
        spans = item_spans(handles, offsets)
        bounds = chunk_bounds(length, chunk_size, spans if keep_whole else ())
        ahead: asyncio.Task | None = None
        try:
            for i, (start, end) in enumerate(bounds):
                current = ahead or asyncio.ensure_future(
                    self.fetch_chunk(handles, offsets, start, end, device)
                )
                ahead = None
                chunk = await current
                if prefetch and i + 1 < len(bounds):
                    ahead = asyncio.ensure_future(
                        self.fetch_chunk(handles, offsets, *bounds[i + 1], device)
                    )
                yield chunk
        finally:
            if ahead is not None:
                ahead.cancel()

    async def describe(self) -> dict[str, Any]:
        return await self._run(self.core.describe())

    async def close(self) -> None:
        await self.transport.close()
        if self.core.store is not None and self.core.store_url is not None:
            await asyncio.to_thread(self.core.store.close)

    async def __aenter__(self) -> AsyncEncoderClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- performing the core's operations ------------------------------------------------------
    async def _run(self, flow: Flow) -> Any:
        """Perform ``flow``'s ops, each tried as the retry policy says (``core.retried``)."""
        steps = retried(flow, self.retry)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    step = steps.send(None)
                else:
                    step = steps.send(await self._try(step))
        except StopIteration as done:
            return done.value

    async def _try(self, op: Any) -> Any:
        """One try of ``op`` (a store call in a worker thread): its answer, or the
        VitserveError it raised."""
        try:
            if isinstance(op, ApiCall):
                return await self.transport.call(op)
            return await asyncio.to_thread(getattr(self.core.store, op.method), *op.args)
        except VitserveError as exc:
            return exc


__all__ = ["AsyncEncoderClient"]
