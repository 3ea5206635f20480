"""Stores as policies over one shared connection (vitserve.cache.base, .connection, .views):
each namespace sees only its own entries, the fingerprint is fixed when a store is made,
counters are a store's own or explicitly shared, and only the connection's owner closes it. Run
over the in-process connection, a real Redis and the node store (on the session's Ray cluster)."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator

import pytest

from vitserve.cache import open_connection, open_store
from vitserve.cache.base import Claim, EmbeddingStore, Pending, StorePolicy
from vitserve.cache.codec import encode_record
from vitserve.cache.connection import Connection
from vitserve.cache.views import StoreViews
from vitserve.errors import ConfigError
from vitserve.testing.records import make_record

FP_A, FP_B = "a" * 64, "b" * 64


@pytest.fixture(params=["memory", "redis", "node"])
def connection(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Connection]:
    prefix = f"v{uuid.uuid4().hex[:8]}"
    if request.param == "node":
        request.getfixturevalue("ray_cluster")  # the session's cluster; the node store's actor
    urls = {"memory": "memory://", "redis": f"{redis_url}?prefix={prefix}", "node": "node://"}
    conn, policy = open_connection(urls[request.param])
    assert policy == StorePolicy()
    yield conn
    conn.close()


def _key() -> str:
    return uuid.uuid4().hex * 2


def test_a_namespace_sees_only_its_entries(connection: Connection) -> None:
    views = StoreViews(connection)
    a, b, bare = views.get("ns.a"), views.get("ns.b"), views.get("")
    assert views.get("ns.a") is a and len(views) == 3
    assert a.connection is b.connection is connection
    record = make_record(8, 16, key=_key())
    a.put_many([record])
    key = record.key
    assert a.get(key) is not None and a.exists_many([key]) == [True]
    # the other namespace (and the one without a namespace) miss it, by every read
    for other in (b, bare):
        assert other.get(key) is None
        assert other.get_value(key) is None
        assert other.exists_many([key]) == [False]
        assert other.headers_many([key]) == [None]
        assert other.get_rows_many([(key, 0, 4)]) == [None]
    # a key stored under the same content key in b is b's own entry, not a's
    b.put_many([record])
    assert b.get(key) is not None
    assert b.delete(key) == 1 and a.get(key) is not None
    # a store made by hand over the same connection, in a's namespace, is a's entries
    assert EmbeddingStore(connection, StorePolicy(namespace="ns.a")).get(key) is not None


def test_claims_and_waits_are_per_namespace(connection: Connection) -> None:
    views = StoreViews(connection)
    a, b = views.get("ns.a"), views.get("ns.b")
    key = _key()
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
    # claims without a token of their own are the connection's, whichever store took them
    assert a.token == b.token == connection.token


def test_the_fingerprint_is_fixed_when_the_store_is_made(connection: Connection) -> None:
    checks_a = StoreViews(connection, StorePolicy(fingerprint=FP_A)).get("ns")
    checks_b = StoreViews(connection, StorePolicy(fingerprint=FP_B)).get("ns")
    with pytest.raises(AttributeError):
        checks_a.fingerprint = FP_B  # type: ignore[misc]
    with pytest.raises(AttributeError):
        checks_a.namespace = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        checks_a.policy.fingerprint = FP_B  # type: ignore[misc]
    record = make_record(8, 16, key=_key(), fingerprint=FP_B)
    checks_b.put_many([record])
    assert checks_b.get(record.key) is not None
    assert checks_a.fingerprint == FP_A
    assert checks_a.headers_many([record.key]) == [None]  # another model's record: a miss
    assert checks_a.stats()["integrity_misses"] == 1


def test_counters_are_shared_among_views_and_apart_from_other_stores(
    connection: Connection,
) -> None:
    views = StoreViews(connection, StorePolicy(fingerprint=FP_A))
    a, b = views.get("ns.a"), views.get("ns.b")
    alone = EmbeddingStore(connection, StorePolicy(namespace="ns.a", fingerprint=FP_A))
    record = make_record(8, 16, key=_key(), fingerprint=FP_A)
    a.put_many([record])
    a.get(record.key)  # a hit
    a.get(_key())  # a miss
    b.get_many([_key(), _key()])  # two misses
    alone.get(record.key)  # a hit, in its own counters only
    for store in (a, b):  # every view reports the views' whole traffic (the replica's gauges)
        stats = store.stats()
        assert (stats["puts"], stats["hits"], stats["misses"]) == (1, 1, 3)
    assert views.stats()["misses"] == 3
    assert (alone.stats()["hits"], alone.stats()["misses"], alone.stats()["puts"]) == (1, 0, 0)
    # the connection's counters are per connection: every store over it shows them
    connection.counters.add("errors", 2)
    assert a.stats()["errors"] == alone.stats()["errors"] == views.stats()["errors"]
    assert a.stats()["errors"] >= 2


def test_only_the_owner_closes_the_connection(connection: Connection) -> None:
    views = StoreViews(connection)
    store = views.get("ns.a")
    key = _key()
    assert store.claim(key, ttl_s=30)  # held under the connection's token
    store.close()  # a view owns nothing: the connection still answers, the claim still holds
    views.close()  # nor does a StoreViews that was not given the connection to own
    [state] = store.lookup_states([key])
    assert state is Pending.CLAIMED
    assert store.exists_many([key]) == [False]
    store.release(key)


@pytest.mark.parametrize("url", ["memory://", "node://"])
def test_closing_the_owner_gives_up_the_connections_claims(
    request: pytest.FixtureRequest, url: str
) -> None:
    if url == "node://":
        request.getfixturevalue("ray_cluster")
    conn, policy = open_connection(url)
    views = StoreViews(conn, policy, owns_connection=True)
    store = views.get("ns")
    key = _key()
    assert store.claim(key, ttl_s=30)
    store.close()
    assert store.lookup_states([key]) == [Pending.CLAIMED]
    views.close()  # the owner: the claims held under the connection's token are given up
    # (a closed connection answers again when called: the node's finds its actor by name)
    assert store.lookup_states([key]) == [Pending.FREE]


def test_open_store_owns_its_connection() -> None:
    store = open_store("memory://?namespace=t1&fingerprint=" + FP_A)
    assert store.owns_connection and (store.namespace, store.fingerprint) == ("t1", FP_A)
    key = _key()
    assert store.claim(key, ttl_s=30)
    view = EmbeddingStore(store.connection, dataclasses.replace(store.policy, namespace="t2"))
    assert not view.owns_connection
    store.close()
    assert store.lookup_states([key]) == [Pending.FREE]


def test_namespaces_are_checked() -> None:
    conn, _ = open_connection("memory://")
    with pytest.raises(ConfigError):
        StoreViews(conn).get("a/b")
    with pytest.raises(ConfigError):
        StoreViews(conn).get("a:b")
    with pytest.raises(ConfigError):
        StorePolicy(namespace="a/b")
    with pytest.raises(ConfigError):
        StorePolicy(ttl_s=0)
