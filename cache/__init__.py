"""vitserve.cache: embedding stores and their wire format (numpy, msgpack, redis; never torch).

A store is a policy (namespace, fingerprint, ttl, counters: :class:`EmbeddingStore`) over a
connection (the backend: :class:`Connection`). ``open_store(url)`` builds any store over a
connection of its own: ``memory://``, ``node://``, ``redis://host:port/db``,
``tiered://?l1=...&l2=...``; ``open_connection(url)`` gives the connection and the policy apart,
for many stores over one connection (:class:`~vitserve.cache.views.StoreViews`). Values use the
record format of :mod:`vitserve.cache.codec`.
"""

from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.codec import EmbeddingRecord, decode_record, encode_record
from vitserve.cache.connection import Connection
from vitserve.cache.urls import open_connection, open_store, tiered_url

__all__ = [
    "Connection",
    "EmbeddingRecord",
    "EmbeddingStore",
    "StorePolicy",
    "decode_record",
    "encode_record",
    "open_connection",
    "open_store",
    "tiered_url",
]
