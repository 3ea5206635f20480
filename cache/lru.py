"""Byte-budgeted LRU with TTL: the bookkeeping of the in-process and node-local stores.

Pure and single-threaded (callers hold their own lock or run on one event loop); ``now`` is
passed in (``time.monotonic()``), so it is testable without sleeping.

Invariants: ``bytes`` is the sum of the held entries' sizes and never exceeds ``max_bytes``
after ``put`` or ``resize`` returns (least recently used entries go first; a value larger than
the budget is refused and counted in ``too_large``); an expired entry is never returned (it is
dropped, and counted in ``expired``, when seen); only ``get`` marks an entry as used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vitserve.errors import ConfigError


@dataclass(slots=True)
class _Entry:
    value: Any
    nbytes: int
    expires: float | None


class ByteBudgetLru:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = 0
        self.bytes = 0
        self.evictions = 0
        self.expired = 0
        self.too_large = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.resize(max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None and entry.expires is not None and entry.expires <= now:
            self.pop(key)
            self.expired += 1
            return None
        return entry

    def _fit(self, size: int) -> None:
        while self._entries and self.bytes + size > self.max_bytes:
            self.pop(next(iter(self._entries)))
            self.evictions += 1

    def resize(self, max_bytes: int) -> None:
        """Set the budget, evicting least recently used entries to fit."""
        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._fit(0)

    def put(self, key: str, value: Any, nbytes: int, expires: float | None) -> bool:
        """Hold ``value`` (replacing any) as the most recently used; False if too large."""
        self.pop(key)
        if nbytes > self.max_bytes:
            self.too_large += 1
            return False
        self._fit(nbytes)
        self._entries[key] = _Entry(value, nbytes, expires)
        self.bytes += nbytes
        return True

    def get(self, key: str, now: float) -> Any | None:
        """The value (marked most recently used), or None if absent or expired."""
        entry = self._live(key, now)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.value

    def contains(self, key: str, now: float) -> bool:
        """Whether a live entry exists (without marking it used)."""
        return self._live(key, now) is not None

    def pop(self, key: str) -> bool:
        """Drop an entry; whether it was held."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.bytes -= entry.nbytes
        return True

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "evictions": self.evictions, "expired": self.expired,
                "too_large": self.too_large}  # fmt: skip
