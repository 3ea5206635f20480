"""vitserve.client: the SDK an LLM server imports to get image embeddings from vitserve.

Light on purpose: httpx, numpy, msgpack and blake3 at import; redis (a Redis store), ray (a
Serve handle or the node-local store), torch (a device) and prometheus_client (metrics) are
imported only when used.

    from vitserve.client import EncoderClient

    with EncoderClient("http://encoder:8000", store="redis://redis:6379/0") as client:
        handles = client.encode([jpeg_bytes, "chart.png"])      # uploads only what is new
        chunk = client.fetch_chunk(handles, offsets, 0, 2048)   # just the rows of [0, 2048)
"""

from vitserve.client.aio import AsyncEncoderClient
from vitserve.client.chunks import ChunkPiece, ImageSpan, chunk_bounds, plan_chunk
from vitserve.client.core import RetryPolicy
from vitserve.client.handles import EncodeWait, FetchedChunk, ImageHandle, Submitted
from vitserve.client.sync import EncoderClient
from vitserve.media import VideoFor

__all__ = [
    "AsyncEncoderClient",
    "ChunkPiece",
    "EncodeWait",
    "EncoderClient",
    "FetchedChunk",
    "ImageHandle",
    "ImageSpan",
    "RetryPolicy",
    "Submitted",
    "VideoFor",
    "chunk_bounds",
    "plan_chunk",
]
