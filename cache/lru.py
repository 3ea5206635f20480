"""Byte-budgeted LRU with TTL: the bookkeeping of the in-process and node-local stores.

Pure and single-threaded (callers hold their own lock or run on one event loop); ``now`` is
passed in (``time.monotonic()``), so it is testable without sleeping.

**Shares.** With ``share_bytes``, each namespace (a full key's part before its last ``/``; one
per tenant) keeps up to ``share_bytes`` of its entries against every other namespace's writes:
to make room, the least recently used entry is evicted among the writer's own and those of
namespaces that stay at or above their share without it. A namespace may hold more than its
share while the budget has room (what it holds beyond is what others may evict). A put that
finds no such room is refused and counted in ``over_share``. Size the budget for the shares
(namespaces x ``share_bytes``), or puts are refused once everyone is within its share.

Invariants: ``bytes`` is the sum of the held entries' sizes and never exceeds ``max_bytes``
after ``put`` or ``resize`` returns (least recently used entries go first; a value larger than
the budget is refused and counted in ``too_large``); an expired entry is never returned (it is
dropped, and counted in ``expired``, when seen); only ``get`` marks an entry as used; with
shares, a put never evicts another namespace's entry that would leave that namespace below
``share_bytes`` (a ``resize`` to a smaller budget may: it is the operator's).
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


def namespace_of(full_key: str) -> str:
    """The namespace part of a full key (``""`` when it has none)."""
    return full_key.rpartition("/")[0]


class ByteBudgetLru:
    def __init__(self, max_bytes: int, share_bytes: int | None = None) -> None:
        self.max_bytes = 0
        self.bytes = 0
        self.evictions = 0
        self.expired = 0
        self.too_large = 0
        self.over_share = 0
        self.share_bytes: int | None = None
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._by_namespace: dict[str, int] = {}  # namespace -> its entries' bytes
        self.resize(max_bytes)
        self.set_share(share_bytes)

    def set_share(self, share_bytes: int | None) -> None:
        """Each namespace's protected bytes (None: no shares, one LRU for all)."""
        if share_bytes is not None and share_bytes <= 0:
            raise ConfigError(f"share_bytes must be positive, got {share_bytes}")
        self.share_bytes = None if share_bytes is None else int(share_bytes)

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

    def _fit_shared(self, size: int, writer: str) -> bool:
        """Make room for ``size`` bytes of ``writer``'s, evicting (least recently used first)
        only what the shares allow; False, evicting nothing, when that cannot make room."""
        share = self.share_bytes
        assert share is not None
        need = self.bytes + size - self.max_bytes
        if need <= 0:
            return True
        victims: list[str] = []
        left = dict(self._by_namespace)  # each namespace's bytes once the victims are gone
        for key, entry in self._entries.items():
            ns = namespace_of(key)
            if ns == writer or left[ns] - entry.nbytes >= share:
                victims.append(key)
                left[ns] -= entry.nbytes
                need -= entry.nbytes
                if need <= 0:
                    break
        if need > 0:
            return False
        for key in victims:
            self.pop(key)
        self.evictions += len(victims)
        return True

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
        ns = namespace_of(key)
        if self.share_bytes is None:
            self._fit(nbytes)
        elif not self._fit_shared(nbytes, ns):
            self.over_share += 1
            return False
        self._entries[key] = _Entry(value, nbytes, expires)
        self.bytes += nbytes
        self._by_namespace[ns] = self._by_namespace.get(ns, 0) + nbytes
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
        ns = namespace_of(key)
        if (left := self._by_namespace[ns] - entry.nbytes) > 0:
            self._by_namespace[ns] = left
        else:
            del self._by_namespace[ns]  # bounded by the namespaces holding entries
        return True

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "evictions": self.evictions,
            "expired": self.expired,
            "too_large": self.too_large,
            "over_share": self.over_share,
        }

    def namespace_bytes(self, namespace: str) -> int:
        """The bytes ``namespace``'s entries hold now."""
        return self._by_namespace.get(namespace, 0)
