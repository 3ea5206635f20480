"""The SDK's ``device="cuda"`` fetch (marked ``gpu``: skipped without a GPU, see tests/gpu.py).

No service: an httpx MockTransport answers ``/healthz`` and the client reads an in-process
memory store directly, as it reads Redis or the node store, so these tests start nothing.

* Rows fetched with ``device="cuda"`` are the stored rows, bit for bit (bf16 words viewed as
  ``torch.bfloat16``, fp16 and fp32 as they are), on the device, through both clients and the
  read-ahead of ``iter_chunks``.
* The copy is really non-blocking (client/device.py stages through pinned memory): with a long
  kernel queued on the stream, ``fetch_chunk`` returns while it still runs, and the rows are
  right once it has run, even though the pinned staging buffers were dropped at once and new
  pinned buffers were written in the meantime.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.blocking import Blocking
from vitserve.cache.codec import EmbeddingRecord
from vitserve.cache.urls import open_store
from vitserve.client import AsyncEncoderClient, EncoderClient, ImageHandle
from vitserve.testing.records import make_record

pytestmark = pytest.mark.gpu

FINGERPRINT = "f" * 64
HEALTH = {"status": "ok", "fingerprint": FINGERPRINT, "namespace": "", "limits": {}}
# Rows and width of the records: big enough that a fetch is several MiB to copy.
ROWS, WIDTH = 1200, 1024


def _health(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/healthz":
        return httpx.Response(200, json=HEALTH)
    raise AssertionError(f"the rows are in the direct store; the client asked {request.url}")


@pytest.fixture
def store() -> Iterator[Any]:
    store = open_store("memory://", namespace="", fingerprint=FINGERPRINT)
    yield store
    store.close()


def _client(flavor: str, store: Any) -> Any:
    if flavor == "sync":
        client = EncoderClient("http://svc", store=store)
        client.transport.client = httpx.Client(
            base_url="http://svc", transport=httpx.MockTransport(_health)
        )
        return client
    aclient = AsyncEncoderClient("http://svc", store=store)
    aclient.transport.client = httpx.AsyncClient(
        base_url="http://svc", transport=httpx.MockTransport(_health)
    )
    return Blocking(aclient)


def _publish(store: Any, dtype: str, extras: int = 0) -> tuple[list[EmbeddingRecord], list]:
    """Two records of ``dtype`` in ``store`` and their handles."""
    records = [
        make_record(ROWS, WIDTH, dtype=dtype, extras=extras, seed=s, fingerprint=FINGERPRINT)
        for s in (1, 2)
    ]
    store.put_many(records)
    handles = [
        ImageHandle(
            key=r.key,
            num_tokens=r.num_tokens,
            grid=r.grid,
            dtype=r.dtype,
            shape=tuple(r.tensors["embedding"].shape),
            cached=True,
            extras=tuple(n for n in r.tensors if n != "embedding"),
        )
        for r in records
    ]
    return records, handles


def _expected(record: EmbeddingRecord, name: str, rows: slice) -> Any:
    """The stored rows as a CPU tensor of the dtype the SDK hands out."""
    import torch

    array = torch.from_numpy(np.array(record.tensors[name][rows]))  # a writable copy
    return array.view(torch.bfloat16) if record.dtype == "bf16" else array


def _check(chunk: Any, records: list[EmbeddingRecord], device: Any) -> None:
    """Every piece of ``chunk`` equals its stored rows bit for bit, on ``device``."""
    import torch

    torch.cuda.synchronize()
    assert chunk.pieces, "the chunk holds no rows"
    for piece, rows, extras in zip(chunk.pieces, chunk.embeddings, chunk.extras, strict=True):
        record = records[piece.image]
        wanted = slice(piece.row_start, piece.row_end)
        assert rows.device == device
        assert torch.equal(rows.cpu(), _expected(record, "embedding", wanted))
        assert set(extras) == set(record.tensors) - {"embedding"}
        for name, tensor in extras.items():
            assert tensor.device == device
            assert torch.equal(tensor.cpu(), _expected(record, name, wanted))


@pytest.mark.parametrize("flavor", ["sync", "async"])
@pytest.mark.parametrize(("dtype", "extras"), [("bf16", 2), ("fp16", 0), ("fp32", 0)])
def test_fetch_chunk_to_cuda_gives_the_stored_rows(
    store: Any, flavor: str, dtype: str, extras: int
) -> None:
    import torch

    records, handles = _publish(store, dtype, extras)
    offsets = [5, 5 + ROWS + 7]
    client = _client(flavor, store)
    try:
        # the chunk starts inside image 0 and ends inside image 1
        chunk = client.fetch_chunk(handles, offsets, 100, offsets[1] + 300, device="cuda")
    finally:
        client.close()
    device = torch.device("cuda", torch.cuda.current_device())
    _check(chunk, records, device)
    assert [p.rows for p in chunk.pieces] == [ROWS - 95, 300]
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    assert all(t.dtype == wanted for t in chunk.embeddings)


@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_iter_chunks_with_read_ahead_to_cuda_gives_every_row(store: Any, flavor: str) -> None:
    import torch

    records, handles = _publish(store, "bf16", extras=1)
    offsets = [0, ROWS + 10]
    length = offsets[1] + ROWS + 10
    client = _client(flavor, store)
    try:
        chunks = list(client.iter_chunks(handles, offsets, length, 512, device="cuda"))
    finally:
        client.close()
    device = torch.device("cuda", torch.cuda.current_device())
    for chunk in chunks:
        _check(chunk, records, device)
    assert sum(c.rows for c in chunks) == 2 * ROWS


# How long the stream is kept busy, and what the fetch may take meanwhile (~ms: host copies of
# a few MiB) to count as not having waited for it.
BUSY_S = 1.0
RETURN_WITHIN_S = BUSY_S / 2


def _queue_long_kernel(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds``: a spin kernel (``torch.cuda._sleep``,
    which torch's own tests use), its cycles per second measured first on this device."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10**7
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_s = cycles / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(per_s * seconds))


def test_the_cuda_fetch_does_not_wait_for_queued_kernels_and_its_rows_survive(
    store: Any,
) -> None:
    """A pageable copy would block the host until the queued kernel finished; the pinned
    staging copy returns at once. The staging buffers are dropped when ``fetch_chunk``
    returns, and pinned buffers allocated and scribbled on right after must not be the ones
    the still-queued copies read from (torch's caching host allocator holds them)."""
    import torch

    records, handles = _publish(store, "bf16", extras=1)
    offsets = [0, ROWS]
    client = _client("sync", store)
    try:
        client.fetch_chunk(handles, offsets, 0, 2 * ROWS, device="cuda")  # warm: pinned pool
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        _queue_long_kernel(BUSY_S)
        started = time.perf_counter()
        chunk = client.fetch_chunk(handles, offsets, 0, 2 * ROWS, device="cuda")
        returned_s = time.perf_counter() - started
        assert returned_s < RETURN_WITHIN_S and not stream.query(), (
            f"fetch_chunk(device='cuda') returned after {returned_s:.3f} s, stream idle: "
            f"{stream.query()}: it waited for the {BUSY_S:g} s kernel queued before it "
            "(a pageable, blocking copy)"
        )
        scribbled = [
            torch.full((ROWS, WIDTH), -1, dtype=torch.int16).pin_memory() for _ in range(8)
        ]
        assert not stream.query(), "the long kernel ended before the test could scribble"
    finally:
        client.close()
    _check(chunk, records, torch.device("cuda", torch.cuda.current_device()))
    assert all(bool((s == -1).all()) for s in scribbled)


def test_async_fetch_chunk_returns_before_queued_kernels_end(store: Any) -> None:
    import torch

    records, handles = _publish(store, "fp16")
    offsets = [0, ROWS]

    async def main() -> Any:
        client = AsyncEncoderClient("http://svc", store=store)
        client.transport.client = httpx.AsyncClient(
            base_url="http://svc", transport=httpx.MockTransport(_health)
        )
        async with client:
            await client.fetch_chunk(handles, offsets, 0, 2 * ROWS, device="cuda")  # warm
            torch.cuda.synchronize()
            _queue_long_kernel(BUSY_S)
            started = time.perf_counter()
            chunk = await client.fetch_chunk(handles, offsets, 0, 2 * ROWS, device="cuda")
            returned_s = time.perf_counter() - started
            busy = not torch.cuda.current_stream().query()
            assert returned_s < RETURN_WITHIN_S and busy, (
                f"the fetch returned after {returned_s:.3f} s: it waited for the kernel"
            )
            return chunk

    chunk = asyncio.run(main())
    _check(chunk, records, torch.device("cuda", torch.cuda.current_device()))
