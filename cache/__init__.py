"""vitserve.cache: embedding stores and their wire format (numpy, msgpack, redis; never torch).

``open_store(url)`` builds any store: ``memory://``, ``node://``, ``redis://host:port/db``,
``tiered://?l1=...&l2=...``. Every store implements :class:`EmbeddingStore`; values use the record
format of :mod:`vitserve.cache.codec`.
"""

from vitserve.cache.base import EmbeddingStore
from vitserve.cache.codec import EmbeddingRecord, decode_record, encode_record
from vitserve.cache.urls import open_store, tiered_url

__all__ = [
    "EmbeddingRecord",
    "EmbeddingStore",
    "decode_record",
    "encode_record",
    "open_store",
    "tiered_url",
]
