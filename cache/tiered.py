"""A local tier (in-process or node-local) in front of a shared tier (Redis).

Reads hit the local tier first; a value found only in the shared tier is promoted into the local
one (the bytes fetched are held as they are, no copy). Writes go to both. Claims go to the
shared tier, so single flight spans replicas.

Degradation: when the shared tier is unavailable (``StoreUnavailableError``), reads, probes and
writes carry on with the local tier alone, claims fall back to the local tier (single flight
within the node), and each failure is counted in ``shared_unavailable``. Errors other than
unavailability are not hidden.

A value that fails a check (corrupt, truncated, another model's) is dropped from both tiers, so
the next encode recomputes it instead of finding the bad value's header again in the other tier.

Both tiers must be opened without a namespace of their own; the tiered store's namespace
applies to both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from vitserve.cache.base import Buffer, EmbeddingStore
from vitserve.cache.codec import RowSpan
from vitserve.errors import ConfigError, StoreError, StoreUnavailableError

T = TypeVar("T")


class TieredStore(EmbeddingStore):
    kind = "tiered"
    head_is_whole_value = False  # the head may be the shared tier's prefix
    verify_payload = True  # a value may come from the shared tier

    def __init__(self, local: EmbeddingStore, shared: EmbeddingStore, **kwargs) -> None:
        super().__init__(**kwargs)
        if local.namespace or shared.namespace:
            raise ConfigError("the tiers of a tiered store must not have namespaces of their own")
        self.local = local
        self.shared = shared

    def _shared(self, call: Callable[[], T], fallback: T) -> T:
        try:
            return call()
        except StoreUnavailableError:
            self._count("shared_unavailable")
            return fallback

    def _put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        self.local._put_values(items, ttl_s)
        self._shared(lambda: self.shared._put_values(items, ttl_s), None)

    def _get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        values = self.local._get_values(full_keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return values
        fetched = self._shared(
            lambda: self.shared._get_values([full_keys[i] for i in missing]), [None] * len(missing)
        )
        promoted = []
        for i, value in zip(missing, fetched, strict=True):
            if value is not None:
                values[i] = value
                promoted.append((full_keys[i], value))
        if promoted:
            self.local._put_values(promoted, self.ttl_s)
            self._count("promotions", len(promoted))
        return values

    def _exists(self, full_keys: list[str]) -> list[bool]:
        found = self.local._exists(full_keys)
        missing = [i for i, f in enumerate(found) if not f]
        if missing:
            shared = self._shared(
                lambda: self.shared._exists([full_keys[i] for i in missing]), [False] * len(missing)
            )
            for i, f in zip(missing, shared, strict=True):
                found[i] = f
        return found

    def _get_head(self, full_key: str) -> Buffer | None:
        head = self.local._get_head(full_key)
        if head is None:
            head = self._shared(lambda: self.shared._get_head(full_key), None)
        return head

    def _get_spans_many(self, items: list[tuple[str, list[RowSpan]]]
                        ) -> list[list[Buffer] | None]:  # fmt: skip
        """The local tier's values sliced, the rest from the shared tier in one call."""
        out = self.local._get_spans_many(items)
        missing = [i for i, chunks in enumerate(out) if chunks is None]
        if missing:
            shared = self._shared(lambda: self.shared._get_spans_many([items[i] for i in missing]),
                                  [None] * len(missing))  # fmt: skip
            for i, chunks in zip(missing, shared, strict=True):
                out[i] = chunks
        return out

    def _delete(self, full_keys: list[str]) -> int:
        local = self.local._delete(full_keys)
        return max(local, self._shared(lambda: self.shared._delete(full_keys), 0))

    def _claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        try:
            return self.shared._claim(full_key, ttl_s, token)
        except StoreUnavailableError:
            self._count("shared_unavailable")
            return self.local._claim(full_key, ttl_s, token)

    def _release(self, full_key: str, token: str) -> None:
        self.local._release(full_key, token)
        self._shared(lambda: self.shared._release(full_key, token), None)

    def _lookup_or_claim(self, full_keys: list[str], ttl_s: float,
                         token: str) -> list[Buffer | bool]:  # fmt: skip
        """The local tier's heads; the rest in one call to the shared tier (its header, or
        its claim), falling back to claims in the local tier when it is unavailable."""
        answers: list[Buffer | bool | None] = list(self.local._get_heads(full_keys))
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fks = [full_keys[i] for i in missing]
            try:
                shared = self.shared._lookup_or_claim(fks, ttl_s, token)
            except StoreUnavailableError:
                self._count("shared_unavailable")
                shared = [self.local._claim(fk, ttl_s, token) for fk in fks]
            for i, answer in zip(missing, shared, strict=True):
                answers[i] = answer
        return answers  # type: ignore[return-value]

    def _lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        """The local tier's heads; the rest in one call to the shared tier (its header, or
        whether its claim is held), falling back to the local tier's claims (those taken while
        the shared tier was down) when it is unavailable."""
        answers: list[Buffer | bool | None] = list(self.local._get_heads(full_keys))
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fks = [full_keys[i] for i in missing]
            try:
                shared = self.shared._lookup_states(fks)
            except StoreUnavailableError:
                self._count("shared_unavailable")
                shared = [self.local._claimed(fk) for fk in fks]
            for i, answer in zip(missing, shared, strict=True):
                answers[i] = answer
        return answers  # type: ignore[return-value]

    def _put_and_release(self, items: list[tuple[str, Buffer]], ttl_s: float | None,
                         releases: list[tuple[str, str]]) -> None:  # fmt: skip
        try:
            self.local._put_values(items, ttl_s)
        finally:
            # claims taken while the shared tier was down live here (one call for them all)
            self.local._put_and_release([], None, releases)
            self._shared(lambda: self.shared._put_and_release(items, ttl_s, releases), None)

    def _claimed(self, full_key: str) -> bool:
        if self.local._claimed(full_key):
            return True
        return self._shared(lambda: self.shared._claimed(full_key), False)

    def _on_bad_value(self, full_key: str, reason: str) -> None:
        """Drop the bad value from both tiers (best effort: the read is already a miss)."""
        for tier in (self.local, self.shared):
            with contextlib.suppress(StoreError):
                tier._delete([full_key])

    def _backend_stats(self) -> dict[str, int]:
        stats = {f"local_{k}": v for k, v in self.local.stats().items()}
        shared = self._shared(self.shared.stats, {})
        stats |= {f"shared_{k}": v for k, v in shared.items()}
        return stats

    def close(self) -> None:
        self.local.close()
        self.shared.close()
