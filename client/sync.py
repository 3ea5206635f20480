"""``EncoderClient``: the blocking client (the operations live in :mod:`vitserve.client.core`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vitserve.cache.codec import EmbeddingRecord
from vitserve.client.base import ClientBase
from vitserve.client.chunks import chunk_bounds, item_spans
from vitserve.client.core import ApiCall, Flow, Sleep, retried
from vitserve.client.device import to_device
from vitserve.client.handles import FetchedChunk, ImageHandle, Submitted
from vitserve.client.inputs import ImageInput
from vitserve.client.transports import (
    HandleTransport,
    HttpTransport,
)
from vitserve.errors import VitserveError
from vitserve.media import VideoFor


class EncoderClient(ClientBase[HttpTransport, HandleTransport]):
    """Encode images through a vitserve service and fetch their embeddings per prefill chunk.

    ``url`` reaches the ingress over HTTP; inside the Ray cluster pass ``handle`` (the ingress
    deployment's ``DeploymentHandle``) instead. ``store`` (a store URL such as
    ``redis://host:6379/0``, or an open ``EmbeddingStore``) makes probes and fetches read the
    store directly, without a hop through the ingress; it is opened under the namespace and
    fingerprint the service reports. ``token``: the bearer token of a service with auth on
    (sent with every call; the service serves the token's tenant, whose namespace it
    reports). ``registry``: a prometheus_client registry for the SDK's metrics.
    """

    http_transport = HttpTransport
    handle_transport = HandleTransport

    # -- the operations ------------------------------------------------------------------------
    def encode(
        self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL
    ) -> list[ImageHandle]:
        """One handle per image (bytes, paths or PIL images), in order; uploads only the images
        the store lacks. A video is sampled ``video_for``'s way (the model's, or vLLM's loader's:
        :class:`~vitserve.media.VideoFor`) and keyed under it."""
        return self._run(self.core.encode(images, video_for))

    def submit(
        self, images: Sequence[ImageInput], video_for: VideoFor = VideoFor.MODEL
    ) -> list[Submitted]:
        """As :meth:`encode`, answered once the new images are claimed, before their
        embeddings are published (a new one is pending: :class:`Submitted`)."""
        return self._run(self.core.submit(images, video_for))

    def probe(self, keys: Sequence[str]) -> list[ImageHandle | None]:
        """The handle of each key the store holds, else None."""
        return self._run(self.core.probe(keys))

    def fetch(self, handles: Sequence[ImageHandle]) -> list[EmbeddingRecord]:
        """Each image's whole record (``.embedding``, ``.extras``, ``.grid``), in order."""
        return self._run(self.core.fetch(handles))

    def fetch_chunk(
        self,
        handles: Sequence[ImageHandle],
        offsets: Sequence[int | Sequence[int]],
        start: int,
        end: int,
        device: Any = None,
    ) -> FetchedChunk:
        """The rows prefill chunk ``[start, end)`` needs; image ``i``'s placeholders start at
        prompt position ``offsets[i]`` (a video whose frame groups the prompt places apart:
        one position per group, ``handles[i].frame_groups()``'s). Numpy views of the fetched
        bytes, or torch tensors moved (non-blocking) to ``device`` when one is given."""
        chunk = self._run(self.core.fetch_chunk(handles, offsets, start, end))
        return to_device(chunk, handles, device) if device is not None else chunk

    def iter_chunks(
        self,
        handles: Sequence[ImageHandle],
        offsets: Sequence[int | Sequence[int]],
        length: int,
        chunk_size: int,
        device: Any = None,
        prefetch: bool = True,
        keep_whole: bool = False,
    ) -> Iterator[FetchedChunk]:
        """``fetch_chunk`` of each chunk of a ``length``-token prompt in turn; with
        ``prefetch``, the next chunk's rows are read (in a worker thread) while the caller
        computes the current one. ``keep_whole``: no chunk edge inside an image (for a
        family whose image tokens attend both ways, Gemma 3; see ``chunk_bounds``)."""
        spans = item_spans(handles, offsets)
        bounds = chunk_bounds(length, chunk_size, spans if keep_whole else ())
        if not prefetch:
            for start, end in bounds:
                yield self.fetch_chunk(handles, offsets, start, end, device)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="vitserve-prefetch") as pool:
            ahead: Future | None = pool.submit(
                self.fetch_chunk, handles, offsets, *bounds[0], device
            )
            for i in range(len(bounds)):
                current = ahead.result()  # type: ignore[union-attr]
                ahead = (
                    pool.submit(self.fetch_chunk, handles, offsets, *bounds[i + 1], device)
                    if i + 1 < len(bounds)
                    else None
                )
                yield current

    def describe(self) -> dict[str, Any]:
        """The service's model, fingerprint, namespace and limits (asked once)."""
        return self._run(self.core.describe())

    def close(self) -> None:
        self.transport.close()
        if self.core.store is not None and self.core.store_url is not None:
            self.core.store.close()

    def __enter__(self) -> EncoderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- performing the core's operations ------------------------------------------------------
    def _run(self, flow: Flow) -> Any:
        """Perform ``flow``'s ops, each tried as the retry policy says (``core.retried``)."""
        steps = retried(flow, self.retry)
        try:
            step = next(steps)
            while True:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = steps.send(None)
                else:
                    step = steps.send(self._try(step))
        except StopIteration as done:
            return done.value

    def _try(self, op: Any) -> Any:
        """One try of ``op``: its answer, or the VitserveError it raised."""
        try:
            if isinstance(op, ApiCall):
                return self.transport.call(op)
            return getattr(self.core.store, op.method)(*op.args)
        except VitserveError as exc:
            return exc


__all__ = ["EncoderClient"]
