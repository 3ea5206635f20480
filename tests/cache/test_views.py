"""Per-namespace views of one store (vitserve.cache.views): each namespace sees only its own
entries, over the root's one connection, with the root's counters and claims. Run over the
in-process store, a real Redis and the node store (on the session's Ray cluster)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

from vitserve.cache import open_store
from vitserve.cache.base import Claim, EmbeddingStore
from vitserve.cache.codec import encode_record
from vitserve.cache.testing import make_record
from vitserve.cache.views import NamespaceView, StoreViews
from vitserve.errors import ConfigError


@pytest.fixture(params=["memory", "redis", "node"])
def root(request: pytest.FixtureRequest, redis_url: str) -> Iterator[EmbeddingStore]:
    prefix = f"v{uuid.uuid4().hex[:8]}"
    if request.param == "node":
        request.getfixturevalue("ray_cluster")  # the session's cluster; the node store's actor
    urls = {"memory": "memory://", "redis": f"{redis_url}?prefix={prefix}", "node": "node://"}
    store = open_store(urls[request.param])
    yield store
    store.close()


def test_a_namespace_sees_only_its_entries(root: EmbeddingStore) -> None:
    views = StoreViews(root)
    a, b = views.get("ns.a"), views.get("ns.b")
    assert views.get("ns.a") is a and views.get("") is root and len(views) == 3
    record = make_record(8, 16, key=uuid.uuid4().hex * 2)
    a.put_many([record])
    key = record.key
    assert a.get(key) is not None and a.exists_many([key]) == [True]
    # the other namespace (and the root) miss it, by every read
    for other in (b, root):
        assert other.get(key) is None
        assert other.get_value(key) is None
        assert other.exists_many([key]) == [False]
        assert other.headers_many([key]) == [None]
        assert other.get_rows_many([(key, 0, 4)]) == [None]
    # a key stored under the same content key in b is b's own entry, not a's
    b.put_many([record])
    assert b.get(key) is not None
    assert b.delete(key) == 1 and a.get(key) is not None


def test_claims_and_waits_are_per_namespace(root: EmbeddingStore) -> None:
    a, b = NamespaceView(root, "ns.a"), NamespaceView(root, "ns.b")
    key = uuid.uuid4().hex * 2
    [won_a] = a.lookup_or_claim([key], 5.0, token="t1")
    [won_b] = b.lookup_or_claim([key], 5.0, token="t2")
    assert won_a is Claim.WON and won_b is Claim.WON  # same key, two namespaces: two claims
    [busy] = a.lookup_or_claim([key], 5.0, token="t3")
    assert busy is Claim.BUSY
    record = make_record(4, 8, key=key)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(a.wait_for(key, 10.0)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting on the claim, not answered by a value already there
    a.put_values([(key, encode_record(record))], release=[(key, "t1")])
    waiter.join(10)
    assert woke == [True]
    assert b.wait_for(key, 0.05) is False  # b's claim is still open, its value never put
    b.release(key, "t2")


def test_one_connection_and_one_set_of_counters(root: EmbeddingStore) -> None:
    a = NamespaceView(root, "ns.a")
    root.fingerprint = "f" * 64
    assert a.fingerprint == "f" * 64
    a.fingerprint = "e" * 64  # the ingress sets it once it knows the model: on the root
    assert root.fingerprint == "e" * 64
    root.fingerprint = None
    before = root.stats()["misses"]
    a.get(uuid.uuid4().hex * 2)
    assert root.stats()["misses"] == before + 1 == a.stats()["misses"]
    assert a.token == root.token
    a.close()  # closes nothing: the root still answers
    assert root.exists_many([uuid.uuid4().hex * 2]) == [False]
    if hasattr(root, "_pool"):
        assert a.root._pool is root._pool


def test_a_view_needs_a_root_without_a_namespace() -> None:
    with pytest.raises(ConfigError):
        NamespaceView(open_store("memory://?namespace=x"), "y")
    with pytest.raises(ConfigError):
        NamespaceView(open_store("memory://"), "")
    with pytest.raises(ConfigError):
        NamespaceView(open_store("memory://"), "a/b")
