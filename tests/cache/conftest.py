"""Store fixtures: every store kind, each test in its own namespace (or private backend)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import STORE_KIND_NEEDS

STORE_KINDS = ("memory", "node", "redis", "tiered", "redis-cluster")


class StoreMaker:
    """Makes stores of one kind; ``peer(store)`` opens a second handle on the same backend (as a
    second replica would)."""

    def __init__(self, kind: str, request: pytest.FixtureRequest, redis_url: str) -> None:
        self.kind = kind
        self.request = request
        self.redis_url = redis_url
        self.opened: list = []
        self.node_actors: list[str] = []

    def __call__(
        self,
        *,
        namespace: str | None = None,
        max_bytes: int | None = None,
        ttl_s: float | None = None,
    ):
        ns = namespace if namespace is not None else uuid.uuid4().hex[:12]
        store = self._open(ns, max_bytes, ttl_s, shared_with=None)
        self.opened.append(store)
        return store

    def peer(self, store):
        max_bytes = getattr(store.connection, "max_bytes", None)
        other = self._open(store.namespace, max_bytes, store.ttl_s, shared_with=store)
        self.opened.append(other)
        return other

    def _open(self, ns: str, max_bytes: int | None, ttl_s: float | None, shared_with):
        from vitserve.cache.memory import MemoryStore

        if self.kind == "memory":
            if shared_with is not None:
                return shared_with  # one process: the peer is the same object
            return MemoryStore(namespace=ns, ttl_s=ttl_s, max_bytes=max_bytes or 1 << 30)
        if self.kind == "node":
            from vitserve.cache.node import NodeStore

            self.request.getfixturevalue("ray_cluster")
            if shared_with is not None:
                name = shared_with.connection.actor_name
            elif max_bytes is None:
                name = "vitserve-test-node-shared"  # one actor for the session; namespaces isolate
            else:  # a budget of its own needs an actor of its own
                name = f"vitserve-test-node-{uuid.uuid4().hex[:8]}"
                self.node_actors.append(name)
            return NodeStore(
                namespace=ns, ttl_s=ttl_s, max_bytes=max_bytes or 1 << 30, actor_name=name
            )
        from vitserve.cache import open_store
        from vitserve.cache.redis_store import RedisStore
        from vitserve.cache.tiered import TieredStore

        if self.kind == "redis-cluster":
            if max_bytes is not None:
                pytest.skip(
                    "a cluster's budget is each primary's maxmemory: "
                    "test_redis_cluster.py::test_each_primary_holds_its_maxmemory"
                )
            return open_store(self.redis_url, namespace=ns, ttl_s=ttl_s)

        if self.kind == "redis":
            url = self.redis_url
            if max_bytes is not None:
                import redis

                url = self.request.getfixturevalue("lru_redis_url")
                client = redis.Redis.from_url(url)
                client.flushdb()
                client.config_set("maxmemory", max_bytes)
                client.close()
            return RedisStore(url, namespace=ns, ttl_s=ttl_s)
        local = MemoryStore(max_bytes=max_bytes or 1 << 30)
        return TieredStore(local, RedisStore(self.redis_url), namespace=ns, ttl_s=ttl_s)

    def close(self) -> None:
        for store in self.opened:
            store.close()
        if self.node_actors:
            import ray

            for name in self.node_actors:
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace="vitserve"))


def store_maker(request: pytest.FixtureRequest) -> Iterator[StoreMaker]:
    """The body of a ``make_store`` fixture parametrized by store kind (tests/multinode has
    one of its own, over the kinds its cluster changes)."""
    # only the kinds that need Redis ask for it: the memory kind's tests are in the fast tier
    needs_redis = "redis" in STORE_KIND_NEEDS[request.param]
    server = "redis_cluster_url" if request.param == "redis-cluster" else "redis_url"
    redis_url = request.getfixturevalue(server) if needs_redis else ""
    maker = StoreMaker(request.param, request, redis_url)
    yield maker
    maker.close()


@pytest.fixture(params=STORE_KINDS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable]:
    yield from store_maker(request)
