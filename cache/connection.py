"""A store's connection: how bytes get in and out of one backend, and nothing about records.

**The rule.** A connection (in-process LRU, node-local actor, Redis, a local tier in front of a
shared one) moves values, heads, claims and waits under *full keys* (``namespace/key``, made by
the store above it). It never builds a key, never decodes a record, never checks a fingerprint
and never counts a hit or a miss: that is the policy of the store over it
(:class:`~vitserve.cache.base.EmbeddingStore`: a namespace, a fingerprint, a ttl and counters).
One connection serves any number of stores, one per namespace (:mod:`vitserve.cache.views`).

Invariants:

* Batches answer one entry per key, in order; missing -> ``None`` / ``False``.
* ``counters`` holds what only the connection knows (``errors``, and a backend's own:
  ``read_cache_hits``, ``shared_unavailable``, ``promotions``); ``stats()`` is those plus the
  backend's figures (its LRU's, the server's). They are counted once per connection, whichever
  store over it made the call.
* ``token`` is the connection's claimant identity: a claim taken without a token of its own is
  held under it, by whichever store over the connection took it.
* ``close`` is called once, by whoever opened the connection (a store that owns it, or the
  caller of :func:`~vitserve.cache.urls.open_connection`); the in-process and node-local
  connections give up the claims held under ``token`` then, a Redis connection's claims end
  with their ttl.
* A connection that cannot reach its backend raises ``StoreUnavailableError`` (retryable)
  within its configured timeout; it never hangs.
* ``claim_scope`` names where its claims (and so its lookups' answers) live when only some
  processes can reach them: a node's store actor, one process's memory. Two connections
  whose scopes differ cannot single-flight one key or find each other's entries (the
  application's parts check it: ``StoreSplitError``); None: wherever the URL leads, the same
  for every process that opens it (Redis).
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any

from vitserve.cache.codec import RowSpan

Buffer = Any  # bytes, memoryview or a 1-D uint8 numpy array


def buffer_nbytes(value: Buffer) -> int:
    """Size in bytes of a value buffer."""
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(value)


class Counters:
    """Named counts, safe to add to from any thread."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class Connection(ABC):
    """One backend; see the module docstring for the contract."""

    #: short backend name, for errors, metrics and URLs
    kind: str = "store"
    #: whether values read back must be checked against their payload checksum (backends whose
    #: bytes are shared with other processes or cross a network)
    verify_payload: bool = True
    #: whether values must be checked in full when they are put (backends whose bytes cannot
    #: change after the put: a bad value is then refused up front)
    verify_on_put: bool = False
    #: whether ``get_head`` returns the whole value (local backends) rather than a prefix
    head_is_whole_value: bool = True

    @property
    def claim_scope(self) -> str | None:
        """Where this connection's claims live, when not every process reaches them (see the
        module's invariants); None: the same for every process opening the same URL."""
        return None

    def __init__(self) -> None:
        self.counters = Counters()
        #: the token claims are held under when their caller names none (see ``claim``)
        self.token = uuid.uuid4().hex

    def stats(self) -> dict[str, int]:
        """The connection's counters and the backend's figures."""
        return {**self.counters.snapshot(), **self.backend_stats()}

    def backend_stats(self) -> dict[str, int]:
        return {}

    # -- values --------------------------------------------------------------------------------
    @abstractmethod
    def put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        """Store each ``(full key, value)``, replacing any, for ``ttl_s`` (None: no expiry)."""

    def put_and_release(
        self,
        items: list[tuple[str, Buffer]],
        ttl_s: float | None,
        releases: list[tuple[str, str]],
    ) -> None:
        """``put_values`` then ``release`` of each ``(full key, token)``; backends that can do
        both in one round trip override it. The claims are released even if the put fails (the
        claimant cannot publish; waiters must not wait for its ttl)."""
        try:
            self.put_values(items, ttl_s)
        finally:
            for full_key, token in releases:
                self.release(full_key, token)

    @abstractmethod
    def get_values(self, full_keys: list[str]) -> list[Buffer | None]: ...

    @abstractmethod
    def exists(self, full_keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def get_head(self, full_key: str) -> Buffer | None:
        """The whole value, or (``head_is_whole_value = False``) at least its prefix and header
        bytes; row reads slice a whole value and call ``get_spans_many`` only after a prefix."""

    def get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        """``get_head`` of several keys (backends may batch it)."""
        return [self.get_head(fk) for fk in full_keys]

    def get_spans_many(
        self,
        items: list[tuple[str, list[RowSpan]]],
    ) -> list[list[Buffer] | None]:
        """Per ``(full key, spans)``, the bytes ``[span.start, span.end)`` of its value, per
        span; None if the value vanished. A remote backend reads them all in one round trip.
        This default serves a backend whose head is the whole value, from its values (one
        ``get_values``)."""
        if not self.head_is_whole_value:
            raise NotImplementedError(f"{type(self).__name__} reads prefixes: read the spans")
        values = self.get_values([fk for fk, _ in items]) if items else []
        return [
            None if v is None else [memoryview(v).cast("B")[sp.start : sp.end] for sp in spans]
            for (_, spans), v in zip(items, values, strict=True)
        ]

    @abstractmethod
    def delete(self, full_keys: list[str]) -> int:
        """Delete keys; returns how many existed."""

    def drop_bad_value(self, full_key: str, reason: str) -> None:  # noqa: B027 - optional hook
        """Called for a value that failed a check (backends may drop it)."""

    # -- claims --------------------------------------------------------------------------------
    @abstractmethod
    def claim(self, full_key: str, ttl_s: float, token: str) -> bool: ...

    @abstractmethod
    def release(self, full_key: str, token: str) -> None: ...

    @abstractmethod
    def claimed(self, full_key: str) -> bool:
        """Whether anyone holds an unexpired claim on the key."""

    def lookup_or_claim(
        self,
        full_keys: list[str],
        ttl_s: float,
        token: str,
    ) -> list[Buffer | bool]:
        """Per key its head bytes (as ``get_heads``), else the outcome of ``claim``. This
        default makes one call per missing key; remote backends override it with one."""
        heads = self.get_heads(full_keys)
        return [
            head if head is not None else self.claim(fk, ttl_s, token)
            for fk, head in zip(full_keys, heads, strict=True)
        ]

    def lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        """Per key its head bytes (as ``get_heads``), else whether anyone holds an unexpired
        claim on it. This default makes one call per missing key; remote backends override it
        with one."""
        heads = self.get_heads(full_keys)
        return [
            head if head is not None else self.claimed(fk)
            for fk, head in zip(full_keys, heads, strict=True)
        ]

    def wait_for(self, full_key: str, timeout_s: float) -> bool:
        """Block until the key is present (True), or until ``timeout_s`` passes or the claim
        on it is gone without a value (False). This default polls; backends that can be woken
        override it."""
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            if self.exists([full_key])[0]:
                return True
            if not self.claimed(full_key):
                return self.exists([full_key])[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles (see the module docstring: who calls it)."""


__all__ = ["Buffer", "Connection", "Counters", "buffer_nbytes"]
