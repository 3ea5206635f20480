"""The in-process store: a byte-budgeted LRU with TTL; the embedded default.

Values are held as the encoded buffers handed to ``put`` (no copy); ``get`` decodes views of
them, so a reader's arrays share memory with the store's entry (read-only) and stay valid after
the entry is evicted. Thread-safe: one lock guards the map; claims wake waiters through a
condition variable.

Invariants: the held bytes never exceed ``max_bytes`` after a put returns (least recently used
entries go first; a single value larger than the budget is refused and counted in
``too_large``); an expired entry is never returned.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from vitserve.cache.base import Buffer, EmbeddingStore, buffer_nbytes
from vitserve.errors import ConfigError

DEFAULT_MAX_BYTES = 1 << 30


@dataclass(slots=True)
class _Entry:
    value: Buffer
    nbytes: int
    expires: float | None  # time.monotonic() deadline


class MemoryStore(EmbeddingStore):
    kind = "memory"
    # Values are checked in full once, when put; the bytes held cannot change afterwards, so
    # reads check headers only.
    verify_on_put = True
    verify_payload = False

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, **kwargs) -> None:
        super().__init__(**kwargs)
        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._claims: dict[str, float] = {}  # full key -> claim deadline
        self._cond = threading.Condition()

    # -- helpers (call with the lock held) -----------------------------------------------------
    def _live(self, full_key: str, now: float) -> _Entry | None:
        entry = self._entries.get(full_key)
        if entry is None:
            return None
        if entry.expires is not None and entry.expires <= now:
            self._drop(full_key)
            self._count("expired")
            return None
        return entry

    def _drop(self, full_key: str) -> None:
        entry = self._entries.pop(full_key)
        self._bytes -= entry.nbytes

    # -- backend -------------------------------------------------------------------------------
    def _put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        now = time.monotonic()
        expires = now + ttl_s if ttl_s is not None else None
        with self._cond:
            for full_key, value in items:
                size = buffer_nbytes(value)
                if full_key in self._entries:
                    self._drop(full_key)
                if size > self.max_bytes:
                    self._count("too_large")
                    continue
                while self._bytes + size > self.max_bytes:
                    oldest = next(iter(self._entries))
                    self._drop(oldest)
                    self._count("evictions")
                self._entries[full_key] = _Entry(value, size, expires)
                self._bytes += size
            self._cond.notify_all()

    def _get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        now = time.monotonic()
        out: list[Buffer | None] = []
        with self._cond:
            for fk in full_keys:
                entry = self._live(fk, now)
                if entry is not None:
                    self._entries.move_to_end(fk)
                out.append(entry.value if entry is not None else None)
        return out

    def _exists(self, full_keys: list[str]) -> list[bool]:
        now = time.monotonic()
        with self._cond:
            return [self._live(fk, now) is not None for fk in full_keys]

    def _get_head(self, full_key: str) -> Buffer | None:
        return self._get_values([full_key])[0]  # the whole value: get_rows slices it

    def _delete(self, full_keys: list[str]) -> int:
        with self._cond:
            found = [fk for fk in full_keys if fk in self._entries]
            for fk in found:
                self._drop(fk)
            return len(found)

    def _claim(self, full_key: str, ttl_s: float) -> bool:
        now = time.monotonic()
        with self._cond:
            deadline = self._claims.get(full_key)
            if deadline is not None and deadline > now:
                return False
            self._claims[full_key] = now + ttl_s
            return True

    def _release(self, full_key: str) -> None:
        with self._cond:
            self._claims.pop(full_key, None)
            self._cond.notify_all()

    def _claimed(self, full_key: str) -> bool:
        with self._cond:
            deadline = self._claims.get(full_key)
            return deadline is not None and deadline > time.monotonic()

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """As the base contract, but woken by puts and releases instead of polling."""
        fk = self.full_key(key)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if self._live(fk, now) is not None:
                    return True
                claim = self._claims.get(fk)
                if claim is None or claim <= now or now >= deadline:
                    return False
                self._cond.wait(min(deadline, claim) - now)

    def _backend_stats(self) -> dict[str, int]:
        with self._cond:
            return {"entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.max_bytes}  # fmt: skip
