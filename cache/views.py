"""Many namespaces (tenants) over one connection: a store per namespace, made once and kept.

**The rule.** A replica serving many tenants opens one connection (one Redis pool, one handle
on the node's store actor, one local tier) and builds, per namespace, an ordinary
:class:`~vitserve.cache.base.EmbeddingStore` over it: the connection is shared, the policy is
the store's own (its namespace, and the fingerprint and ttl all these stores share).

Invariants:

* Each store's namespace is fixed when it is made; its reads, probes, claims, waits and writes
  touch only ``<namespace>/<key>`` entries. A key stored under another namespace is a miss in
  this one, exactly as a key never stored.
* One fingerprint and one ttl for every namespace (the ``policy`` given here); a store for
  another fingerprint is another ``StoreViews`` over the same connection.
* Counters are shared, explicitly: every store made here counts in this object's
  ``counters``, so any one of them (and ``stats()`` here) reports the replica's whole store
  traffic, whichever tenants made it: what the replica's gauges report (they have no tenant
  label: tenants are unbounded).
* Claims are held under the connection's token, whichever namespace's store took them.
* Closing: the stores made here close nothing; ``close()`` here closes the connection if this
  object was given it to own (``owns_connection``), else it is left to whoever opened it.
"""

from __future__ import annotations

import dataclasses
import threading

from vitserve.cache.base import STAT_NAMES, EmbeddingStore, StorePolicy
from vitserve.cache.connection import Connection, Counters


class StoreViews:
    """The stores of ``connection``, one per namespace, under ``policy`` (its namespace is
    replaced by each store's; see the module docstring)."""

    def __init__(
        self,
        connection: Connection,
        policy: StorePolicy | None = None,
        *,
        counters: Counters | None = None,
        owns_connection: bool = False,
    ) -> None:
        """``counters``: to share with stores made elsewhere (None: this object's own)."""
        self.connection = connection
        self.policy = policy if policy is not None else StorePolicy()
        self.counters = counters if counters is not None else Counters()
        self.owns_connection = owns_connection
        self._stores: dict[str, EmbeddingStore] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str) -> EmbeddingStore:
        """The store of ``namespace`` (made at first use, then the same object)."""
        store = self._stores.get(namespace)
        if store is None:
            with self._lock:
                store = self._stores.get(namespace)
                if store is None:  # StorePolicy refuses a namespace with ':' or '/'
                    policy = dataclasses.replace(self.policy, namespace=namespace)
                    store = EmbeddingStore(self.connection, policy, counters=self.counters)
                    self._stores[namespace] = store
        return store

    def stats(self) -> dict[str, int]:
        """The shared counters, then the connection's (as each store's ``stats()``)."""
        return {
            **dict.fromkeys(STAT_NAMES, 0),
            **self.counters.snapshot(),
            **self.connection.stats(),
        }

    def close(self) -> None:
        """Close the connection if this object owns it."""
        if self.owns_connection:
            self.connection.close()

    def __len__(self) -> int:
        return len(self._stores)


__all__ = ["StoreViews"]
