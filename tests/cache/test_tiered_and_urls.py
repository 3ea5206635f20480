"""open_store URLs, and the tiered store degrading to its local tier when Redis is down."""

from __future__ import annotations

import time

import pytest

from vitserve.cache import open_store, tiered_url
from vitserve.cache.memory import MemoryConnection, MemoryStore
from vitserve.cache.redis_store import RedisConnection, RedisStore
from vitserve.cache.tiered import TieredConnection, TieredStore
from vitserve.cache.urls import parse_size
from vitserve.errors import ConfigError, StoreUnavailableError
from vitserve.testing.records import make_record


def test_urls_build_every_store(redis_url) -> None:
    memory = open_store("memory://?max_bytes=64MiB&ttl_s=30&namespace=t1")
    assert isinstance(memory.connection, MemoryConnection)
    assert (memory.connection.max_bytes, memory.ttl_s, memory.namespace) == (64 * 2**20, 30.0, "t1")
    redis_store = open_store(redis_url + "?timeout_s=0.5&prefix=x")
    assert isinstance(redis_store.connection, RedisConnection)
    assert (redis_store.connection.timeout_s, redis_store.connection.prefix) == (0.5, "x")
    tiered = open_store(tiered_url("memory://?max_bytes=1GiB", redis_url, namespace="t2"))
    assert isinstance(tiered.connection, TieredConnection) and tiered.namespace == "t2"
    tiers = tiered.connection
    assert isinstance(tiers.local, MemoryConnection) and isinstance(tiers.shared, RedisConnection)
    record = make_record(seed=1)
    tiered.put_many([record])
    assert redis_store.exists_many([record.key]) == [False]  # other namespace and prefix
    for store in (memory, redis_store, tiered):
        store.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://?max_byte=1", "unknown store option 'max_byte'"),
        ("memory://?max_bytes=lots", "invalid size"),
        ("memcached://host", "unknown store URL"),
        ("tiered://?l1=memory://", "needs l1= and l2="),
        ("memory://?ttl_s=-1", "ttl_s must be positive"),
        ("memory://?namespace=a:b", "may not contain"),
        (tiered_url("memory://?namespace=x", "memory://"), "tiers of a tiered store take no"),
    ],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_store(url)


def test_sizes() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("512MiB") == parse_size("512m") == 512 * 2**20
    assert parse_size("2GiB") == 2 * 2**30


def test_redis_down_raises_unavailable_within_the_timeout(spawn_redis) -> None:
    server = spawn_redis()
    server.kill()  # a free port where nothing listens
    store = RedisStore(server.url, timeout_s=0.5)
    for call in (
        lambda: store.get_many(["a" * 64]),
        lambda: store.put_many([make_record()]),
        lambda: store.exists_many(["a" * 64]),
    ):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError) as info:
            call()
        assert time.monotonic() - start < 1.5
        assert info.value.retryable


def test_tiered_keeps_serving_its_local_tier_when_redis_dies(spawn_redis) -> None:
    server = spawn_redis()
    shared = RedisStore(server.url, timeout_s=0.5)
    tiered = TieredStore(MemoryStore(), shared, namespace="ns")
    before, only_in_redis, after = make_record(seed=1), make_record(seed=2), make_record(seed=3)
    tiered.put_many([before])
    RedisStore(server.url, namespace="ns").put_many([only_in_redis])
    assert tiered.get(only_in_redis.key) is not None  # fetched from Redis, promoted

    server.kill()
    start = time.monotonic()
    got = tiered.get_many([before.key, only_in_redis.key, "0" * 64])
    assert got[0] is not None and got[1] is not None and got[2] is None
    assert time.monotonic() - start < 1.5  # one timeout at most, then the local answer
    tiered.put_many([after])  # writes degrade to the local tier
    assert tiered.get(after.key) is not None
    assert tiered.exists_many([before.key, after.key]) == [True, True]
    assert tiered.get_rows(before.key, 0, 5) is not None
    assert tiered.claim(after.key, ttl_s=5)  # single flight falls back to the node
    assert not tiered.claim(after.key, ttl_s=5)
    assert tiered.stats()["shared_unavailable"] >= 4
