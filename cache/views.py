"""Per-namespace views of one store: many namespaces (tenants), one connection.

A :class:`NamespaceView` is an :class:`~vitserve.cache.base.EmbeddingStore` whose keys live
under its own namespace and whose every backend operation is its root store's (the same Redis
connection pool, node-store actor handle, local tier). It costs a few attributes: a replica
serving many tenants opens its store once and takes a view per tenant (:class:`StoreViews`).

Invariants:

* The root has no namespace of its own; a view's ``full_key`` adds the prefix, so a view reads,
  probes, claims, waits on and writes only ``<namespace>/<key>`` entries. A key stored under
  another namespace is a miss in this one, exactly as a key never stored.
* Counters are the root's (one ``stats()`` per replica, whichever views counted); the
  fingerprint and ttl are the root's (setting a view's fingerprint sets the root's).
* Claims are held under the root's token, so the root's ``close`` gives them up; closing a
  view closes nothing.
"""

from __future__ import annotations

import threading

from vitserve.cache.base import Buffer, EmbeddingStore
from vitserve.cache.codec import RowSpan
from vitserve.errors import ConfigError


class NamespaceView(EmbeddingStore):
    """``root``'s entries under ``namespace`` (see the module docstring)."""

    def __init__(self, root: EmbeddingStore, namespace: str) -> None:
        # EmbeddingStore.__init__ is not called: its counters, token and settings are the root's.
        if root.namespace:
            raise ConfigError(f"a namespace view needs a root store without a namespace; "
                              f"{root!r} has {root.namespace!r}")  # fmt: skip
        if not namespace or ":" in namespace or "/" in namespace:
            raise ConfigError(f"a view's namespace must be non-empty, without ':' or '/': "
                              f"{namespace!r}")  # fmt: skip
        self.root = root
        self.namespace = namespace
        self.kind = root.kind
        self.verify_payload = root.verify_payload
        self.verify_on_put = root.verify_on_put
        self.head_is_whole_value = root.head_is_whole_value
        self._counts = root._counts
        self._counts_lock = root._counts_lock
        self.token = root.token

    def __repr__(self) -> str:
        return f"NamespaceView({self.root!r}, namespace={self.namespace!r})"

    @property  # type: ignore[override]
    def fingerprint(self) -> str | None:
        return self.root.fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str | None) -> None:
        self.root.fingerprint = value

    @property  # type: ignore[override]
    def ttl_s(self) -> float | None:
        return self.root.ttl_s

    # -- the backend: the root's, with the view's full keys ------------------------------------
    def _put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        self.root._put_values(items, ttl_s)

    def _put_and_release(self, items: list[tuple[str, Buffer]], ttl_s: float | None,
                         releases: list[tuple[str, str]]) -> None:  # fmt: skip
        self.root._put_and_release(items, ttl_s, releases)

    def _get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        return self.root._get_values(full_keys)

    def _exists(self, full_keys: list[str]) -> list[bool]:
        return self.root._exists(full_keys)

    def _get_head(self, full_key: str) -> Buffer | None:
        return self.root._get_head(full_key)

    def _get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        return self.root._get_heads(full_keys)

    def _get_spans_many(self, items: list[tuple[str, list[RowSpan]]]
                        ) -> list[list[Buffer] | None]:  # fmt: skip
        return self.root._get_spans_many(items)

    def _lookup_or_claim(self, full_keys: list[str], ttl_s: float,
                         token: str) -> list[Buffer | bool]:  # fmt: skip
        return self.root._lookup_or_claim(full_keys, ttl_s, token)

    def _lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        return self.root._lookup_states(full_keys)

    def _delete(self, full_keys: list[str]) -> int:
        return self.root._delete(full_keys)

    def _claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        return self.root._claim(full_key, ttl_s, token)

    def _release(self, full_key: str, token: str) -> None:
        self.root._release(full_key, token)

    def _claimed(self, full_key: str) -> bool:
        return self.root._claimed(full_key)

    def _on_bad_value(self, full_key: str, reason: str) -> None:
        self.root._on_bad_value(full_key, reason)

    def _backend_stats(self) -> dict[str, int]:
        return self.root._backend_stats()

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """The root's wait (woken by the backend where it can be), on this view's full key:
        the root has no namespace, so its full key of ``<namespace>/<key>`` is itself."""
        return self.root.wait_for(self.full_key(key), timeout_s)

    def close(self) -> None:
        """Nothing: the connection is the root's."""


class StoreViews:
    """One root store and its views, one per namespace, made at first use and kept (a
    replica's namespaces come from its configuration: the config's own and its tenants')."""

    def __init__(self, root: EmbeddingStore) -> None:
        self.root = root
        self._views: dict[str, EmbeddingStore] = {root.namespace: root}
        self._lock = threading.Lock()

    def get(self, namespace: str) -> EmbeddingStore:
        """The store of ``namespace``: the root itself for its own, else a view of it."""
        view = self._views.get(namespace)
        if view is None:
            with self._lock:
                view = self._views.get(namespace)
                if view is None:
                    view = self._views[namespace] = NamespaceView(self.root, namespace)
        return view

    def __len__(self) -> int:
        return len(self._views)


__all__ = ["NamespaceView", "StoreViews"]
