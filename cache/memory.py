"""The in-process connection: a byte-budgeted LRU with TTL; the embedded default.

Values are held as the encoded buffers handed to ``put`` (no copy); ``get`` decodes views of
them, so a reader's arrays share memory with the store's entry (read-only) and stay valid after
the entry is evicted. Thread-safe: one lock guards the index; claims wake waiters through a
condition variable.

:class:`MemoryStore` is a store over a connection of its own (it owns it and closes it).
``BACKEND`` declares the URL it serves (``memory://?max_bytes=1GiB&share_bytes=...``) to the
table of :mod:`vitserve.cache.urls`.

Invariants:

* Those of :class:`~vitserve.cache.lru.ByteBudgetLru`: the held bytes never exceed
  ``max_bytes`` after a put returns (least recently used entries go first; a single value
  larger than the budget is refused and counted in ``too_large``); an expired entry is never
  returned.
* Closing the connection gives up the claims held under its token.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from vitserve.cache.backend import Backend, Opener, parse_size, take_policy
from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.connection import Buffer, Connection, buffer_nbytes
from vitserve.cache.lru import ByteBudgetLru

DEFAULT_MAX_BYTES = 1 << 30


class MemoryConnection(Connection):
    kind = "memory"

    @property
    def claim_scope(self) -> str:
        """This process's memory, this object's: no other process finds its entries."""
        return f"memory://pid-{os.getpid()}/{id(self):x}"

    # Values are checked in full once, when put; the bytes held cannot change afterwards, so
    # reads check headers only.
    verify_on_put = True
    verify_payload = False

    def __init__(
        self, *, max_bytes: int = DEFAULT_MAX_BYTES, share_bytes: int | None = None
    ) -> None:
        super().__init__()
        self._lru = ByteBudgetLru(max_bytes, share_bytes)  # shares: see ByteBudgetLru
        self._claims: dict[str, tuple[float, str]] = {}  # full key -> (deadline, token)
        self._cond = threading.Condition()

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    def put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        expires = time.monotonic() + ttl_s if ttl_s is not None else None
        with self._cond:
            for full_key, value in items:
                self._lru.put(full_key, value, buffer_nbytes(value), expires)
            self._cond.notify_all()

    def get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        now = time.monotonic()
        with self._cond:
            return [self._lru.get(fk, now) for fk in full_keys]

    def exists(self, full_keys: list[str]) -> list[bool]:
        now = time.monotonic()
        with self._cond:
            return [self._lru.contains(fk, now) for fk in full_keys]

    def get_head(self, full_key: str) -> Buffer | None:
        return self.get_values([full_key])[0]  # the whole value: get_rows slices it

    def delete(self, full_keys: list[str]) -> int:
        with self._cond:
            return sum(self._lru.pop(fk) for fk in full_keys)

    def claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        now = time.monotonic()
        with self._cond:
            claim = self._claims.get(full_key)
            if claim is not None and claim[0] > now:
                return False
            self._claims[full_key] = (now + ttl_s, token)
            return True

    def release(self, full_key: str, token: str) -> None:
        with self._cond:
            claim = self._claims.get(full_key)
            if claim is not None and claim[1] == token:
                del self._claims[full_key]
                self._cond.notify_all()

    def claimed(self, full_key: str) -> bool:
        with self._cond:
            claim = self._claims.get(full_key)
            return claim is not None and claim[0] > time.monotonic()

    def wait_for(self, full_key: str, timeout_s: float) -> bool:
        """As the base contract, but woken by puts and releases instead of polling."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if self._lru.contains(full_key, now):
                    return True
                claim = self._claims.get(full_key)
                if claim is None or claim[0] <= now or now >= deadline:
                    return False
                self._cond.wait(min(deadline, claim[0]) - now)

    def backend_stats(self) -> dict[str, int]:
        with self._cond:
            return self._lru.stats()

    def close(self) -> None:
        """Give up the claims held under this connection's token (waiters wake)."""
        with self._cond:
            mine = [fk for fk, (_, token) in self._claims.items() if token == self.token]
            for fk in mine:
                del self._claims[fk]
            self._cond.notify_all()


class MemoryStore(EmbeddingStore):
    """A store over an in-process connection of its own."""

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
    ) -> None:
        super().__init__(
            MemoryConnection(max_bytes=max_bytes),
            StorePolicy(namespace=namespace, fingerprint=fingerprint, ttl_s=ttl_s),
            owns_connection=True,
        )


def _from_url(
    url: str, options: dict[str, Any], open_url: Opener
) -> tuple[MemoryConnection, StorePolicy]:
    policy = take_policy(options)
    return MemoryConnection(**options), policy


BACKEND = Backend(
    schemes=("memory",),
    options={"max_bytes": parse_size, "share_bytes": parse_size},
    from_url=_from_url,
)
