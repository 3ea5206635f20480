"""A local tier (in-process or node-local) in front of a shared tier (Redis): one connection.

:class:`TieredConnection` joins two connections; :class:`TieredStore` is a store over a tiered
connection of its own. ``BACKEND`` declares the URL it serves to the table of
:mod:`vitserve.cache.urls`: ``tiered://?l1=<local store URL>&l2=<shared store URL>``, each
tier opened by the opener the table hands it (this module imports no other backend).

Invariants:

* Reads hit the local tier first; a value found only in the shared tier is promoted into the
  local one (the bytes fetched are held as they are, no copy). Writes go to both. Claims go to
  the shared tier, so single flight spans replicas.
* Degradation: when the shared tier is unavailable (``StoreUnavailableError``), reads, probes
  and writes carry on with the local tier alone, claims fall back to the local tier (single
  flight within the node), and each failure is counted in ``shared_unavailable``. Errors other
  than unavailability are not hidden.
* A value that fails a check (corrupt, truncated, another model's) is dropped from both tiers,
  so the next encode recomputes it instead of finding the bad value's header again in the
  other tier.
* The tiers are connections: they know no namespace, so the namespace of the store over the
  tiered connection applies to both (a tier's URL takes no namespace, fingerprint or ttl_s of
  its own). A promoted value is held in the local tier for the tiered connection's
  ``promote_ttl_s`` (the ``ttl_s`` of its URL; None: until evicted), whichever store read it.
  Closing the tiered connection closes both tiers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from vitserve.cache.backend import Backend, Opener, take_policy
from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.codec import RowSpan
from vitserve.cache.connection import Buffer, Connection
from vitserve.cache.redaction import redact_url
from vitserve.errors import ConfigError, StoreError, StoreUnavailableError

T = TypeVar("T")


class TieredConnection(Connection):
    kind = "tiered"

    @property
    def claim_scope(self) -> str | None:
        """The shared tier's: claims and lookups that decide go there."""
        return self.shared.claim_scope

    head_is_whole_value = False  # the head may be the shared tier's prefix
    verify_payload = True  # a value may come from the shared tier

    def __init__(
        self, local: Connection, shared: Connection, *, promote_ttl_s: float | None = None
    ) -> None:
        super().__init__()
        if promote_ttl_s is not None and promote_ttl_s <= 0:
            raise ConfigError(f"promote_ttl_s must be positive, got {promote_ttl_s}")
        self.local = local
        self.shared = shared
        self.promote_ttl_s = promote_ttl_s

    def _shared(self, call: Callable[[], T], fallback: T) -> T:
        try:
            return call()
        except StoreUnavailableError:
            self.counters.add("shared_unavailable")
            return fallback

    def put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        self.local.put_values(items, ttl_s)
        self._shared(lambda: self.shared.put_values(items, ttl_s), None)

    def get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        values = self.local.get_values(full_keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if not missing:
            return values
        absent: list[Buffer | None] = [None] * len(missing)
        fetched = self._shared(
            lambda: self.shared.get_values([full_keys[i] for i in missing]), absent
        )
        promoted: list[tuple[str, Buffer]] = []
        for i, value in zip(missing, fetched, strict=True):
            if value is not None:
                values[i] = value
                promoted.append((full_keys[i], value))
        if promoted:
            self.local.put_values(promoted, self.promote_ttl_s)
            self.counters.add("promotions", len(promoted))
        return values

    def exists(self, full_keys: list[str]) -> list[bool]:
        found = self.local.exists(full_keys)
        missing = [i for i, f in enumerate(found) if not f]
        if missing:
            shared = self._shared(
                lambda: self.shared.exists([full_keys[i] for i in missing]), [False] * len(missing)
            )
            for i, f in zip(missing, shared, strict=True):
                found[i] = f
        return found

    def get_head(self, full_key: str) -> Buffer | None:
        head = self.local.get_head(full_key)
        if head is None:
            head = self._shared(lambda: self.shared.get_head(full_key), None)
        return head

    def get_spans_many(self, items: list[tuple[str, list[RowSpan]]]) -> list[list[Buffer] | None]:
        """The local tier's values sliced, the rest from the shared tier in one call."""
        out = self.local.get_spans_many(items)
        missing = [i for i, chunks in enumerate(out) if chunks is None]
        if missing:
            absent: list[list[Buffer] | None] = [None] * len(missing)
            shared = self._shared(
                lambda: self.shared.get_spans_many([items[i] for i in missing]), absent
            )
            for i, chunks in zip(missing, shared, strict=True):
                out[i] = chunks
        return out

    def delete(self, full_keys: list[str]) -> int:
        local = self.local.delete(full_keys)
        return max(local, self._shared(lambda: self.shared.delete(full_keys), 0))

    def claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        try:
            return self.shared.claim(full_key, ttl_s, token)
        except StoreUnavailableError:
            self.counters.add("shared_unavailable")
            return self.local.claim(full_key, ttl_s, token)

    def release(self, full_key: str, token: str) -> None:
        self.local.release(full_key, token)
        self._shared(lambda: self.shared.release(full_key, token), None)

    def lookup_or_claim(
        self, full_keys: list[str], ttl_s: float, token: str
    ) -> list[Buffer | bool]:
        """The local tier's heads; the rest in one call to the shared tier (its header, or
        its claim), falling back to claims in the local tier when it is unavailable."""
        answers: list[Buffer | bool | None] = list(self.local.get_heads(full_keys))
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fks = [full_keys[i] for i in missing]
            try:
                shared = self.shared.lookup_or_claim(fks, ttl_s, token)
            except StoreUnavailableError:
                self.counters.add("shared_unavailable")
                shared = [self.local.claim(fk, ttl_s, token) for fk in fks]
            for i, answer in zip(missing, shared, strict=True):
                answers[i] = answer
        return answers  # every None replaced above

    def lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        """The local tier's heads; the rest in one call to the shared tier (its header, or
        whether its claim is held), falling back to the local tier's claims (those taken while
        the shared tier was down) when it is unavailable."""
        answers: list[Buffer | bool | None] = list(self.local.get_heads(full_keys))
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            fks = [full_keys[i] for i in missing]
            try:
                shared = self.shared.lookup_states(fks)
            except StoreUnavailableError:
                self.counters.add("shared_unavailable")
                shared = [self.local.claimed(fk) for fk in fks]
            for i, answer in zip(missing, shared, strict=True):
                answers[i] = answer
        return answers  # every None replaced above

    def put_and_release(
        self, items: list[tuple[str, Buffer]], ttl_s: float | None, releases: list[tuple[str, str]]
    ) -> None:
        try:
            self.local.put_values(items, ttl_s)
        finally:
            # claims taken while the shared tier was down live here (one call for them all)
            self.local.put_and_release([], None, releases)
            self._shared(lambda: self.shared.put_and_release(items, ttl_s, releases), None)

    def claimed(self, full_key: str) -> bool:
        if self.local.claimed(full_key):
            return True
        return self._shared(lambda: self.shared.claimed(full_key), False)

    def drop_bad_value(self, full_key: str, reason: str) -> None:
        """Drop the bad value from both tiers (best effort: the read is already a miss)."""
        for tier in (self.local, self.shared):
            with contextlib.suppress(StoreError):
                tier.delete([full_key])

    def backend_stats(self) -> dict[str, int]:
        stats = {f"local_{k}": v for k, v in self.local.stats().items()}
        unavailable: dict[str, int] = {}
        shared = self._shared(self.shared.stats, unavailable)
        stats |= {f"shared_{k}": v for k, v in shared.items()}
        return stats

    def close(self) -> None:
        self.local.close()
        self.shared.close()


class TieredStore(EmbeddingStore):
    """A store over a tiered connection of its own. ``local`` and ``shared``: connections, or
    stores without a namespace whose connections this store takes over (and closes); the
    policy's ``ttl_s`` is also the promotions' ttl."""

    def __init__(
        self,
        local: Connection | EmbeddingStore,
        shared: Connection | EmbeddingStore,
        *,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
    ) -> None:
        tiers = []
        for tier in (local, shared):
            if isinstance(tier, EmbeddingStore):
                if tier.namespace:
                    raise ConfigError(
                        "the tiers of a tiered store must not have namespaces of their own"
                    )
                tier = tier.connection
            tiers.append(tier)
        policy = StorePolicy(namespace=namespace, fingerprint=fingerprint, ttl_s=ttl_s)
        connection = TieredConnection(tiers[0], tiers[1], promote_ttl_s=ttl_s)
        super().__init__(connection, policy, owns_connection=True)


def _from_url(
    url: str, options: dict[str, Any], open_url: Opener
) -> tuple[TieredConnection, StorePolicy]:
    """The tiered connection of ``url`` over its tiers' (``open_url`` opens them), its policy
    the tiered URL's own: the tiers' URLs may hold none."""
    try:
        l1, l2 = options.pop("l1"), options.pop("l2")
    except KeyError:
        raise ConfigError(
            f"tiered store needs l1= and l2= store URLs: {redact_url(url)!r}"
        ) from None
    policy = take_policy(options)
    local, local_policy = open_url(l1)
    try:
        shared, shared_policy = open_url(l2)
    except BaseException:
        local.close()
        raise
    if (local_policy, shared_policy) != (StorePolicy(), StorePolicy()):
        local.close()
        shared.close()
        raise ConfigError(
            "the tiers of a tiered store take no namespace, fingerprint or ttl_s of their "
            f"own (give them to the tiered URL): {redact_url(url)!r}"
        )
    return TieredConnection(local, shared, promote_ttl_s=policy.ttl_s), policy


BACKEND = Backend(schemes=("tiered",), options={"l1": str, "l2": str}, from_url=_from_url)
