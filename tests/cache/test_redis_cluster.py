"""The Redis Cluster connection against real local clusters: what only a cluster does (the
cross-store contract, the cluster kind included, is test_conformance.py). Keys spread over the
shards with each record's value and claim on one slot, the URL and its refusals, the shards'
maxmemory as the budget, and a primary killed under load: right answers or a retryable error
during the election, then service again on the same store object, nobody acting.

The suite's cluster (``redis_cluster_url``: three primaries, three replicas) serves the shared
tests; the budget and failover tests start clusters of their own (``spawn_redis_cluster``).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from vitserve.cache import open_store
from vitserve.cache.base import Claim, EmbeddingStore
from vitserve.cache.codec import encode_record
from vitserve.cache.redis_acl import reader_acl, server_reader_acl, writer_acl
from vitserve.errors import ConfigError, StoreError, StoreUnavailableError
from vitserve.testing.records import make_record, new_key


@pytest.fixture
def open_cluster(redis_cluster_url: str) -> Iterator[Callable[..., EmbeddingStore]]:
    """Opens stores on a cluster (the suite's unless ``url`` is given), closed at teardown;
    each call gets a fresh namespace unless one is given."""
    opened: list[EmbeddingStore] = []

    def open_(url: str | None = None, *, namespace: str | None = None, **kw) -> EmbeddingStore:
        ns = namespace if namespace is not None else uuid.uuid4().hex[:12]
        opened.append(open_store(url or redis_cluster_url, namespace=ns, **kw))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


# -- the URL -------------------------------------------------------------------------------------
def test_the_cluster_url_and_what_it_refuses() -> None:
    """Opening connects nothing (a replica may start before the cluster); the name shows the
    scheme, user and seed node, never the password; a budget ledger, a database other than 0
    and a prefix that would become the hash tag are refused."""
    store = open_store("redis+cluster://reader:s3cret@127.0.0.1:1?timeout_s=0.5&retries=0")
    try:
        assert store.kind == "redis-cluster"
        assert (
            "s3cret" not in store.connection.name and "reader@127.0.0.1:1" in store.connection.name
        )
    finally:
        store.close()
    for url, says in [
        ("redis+cluster://127.0.0.1:7000?max_bytes=1GiB", "one Redis server"),
        ("redis+cluster://127.0.0.1:7000/3", "database 0 only"),
        ("redis+cluster://127.0.0.1:7000?prefix=a%7Bb", "may not hold"),
        ("redis+cluster://127.0.0.1:7000?ssl_ca_certs=/x.pem", "rediss://"),
        ("redis+cluster://127.0.0.1:7000?retries=-1", "at least 0"),
        ("redis+cluster://127.0.0.1:7000?db=2", "unknown store option"),
    ]:
        with pytest.raises(ConfigError, match=says):
            open_store(url)


def test_nothing_listening_is_unavailable_within_the_timeout(spawn_redis) -> None:
    """A seed node that does not answer: every operation a StoreUnavailableError (retryable),
    each within about the timeout, never a hang."""
    from vitserve.deployments.runner.local import free_port

    store = open_store(f"redis+cluster://127.0.0.1:{free_port()}?timeout_s=0.5&retries=0")
    try:
        for call in (
            lambda: store.get(new_key()),
            lambda: store.exists_many([new_key()]),
            lambda: store.lookup_or_claim([new_key()], 5.0),
            lambda: store.put_many([make_record(rows=2, width=8)]),
        ):
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError):
                call()
            assert time.monotonic() - started < 3.0
    finally:
        store.close()


# -- the layout ---------------------------------------------------------------------------------
def test_records_spread_over_the_shards_and_each_value_shares_its_claims_slot(
    open_cluster, redis_cluster_url: str
) -> None:
    """48 records: claimed in one call, published with their claims released in one call,
    read back in one; each value's key and its claim's hash to one slot, the keys to many
    slots, and every primary holds some."""
    store, peer = open_cluster(), None
    records = [make_record(rows=4, width=16, seed=i) for i in range(48)]
    keys = [r.key for r in records]
    assert store.lookup_or_claim(keys, 30.0) == [Claim.WON] * len(keys)
    peer = open_cluster(namespace=store.namespace)
    assert peer.lookup_or_claim(keys[:3], 30.0) == [Claim.BUSY] * 3
    store.put_values(
        [(r.key, encode_record(r)) for r in records], release=[(k, store.token) for k in keys]
    )
    assert [h.key for h in peer.lookup_or_claim(keys, 30.0)] == keys  # headers: held now
    assert not any(peer.connection.claimed(store.full_key(k)) for k in keys)  # released
    conn = store.connection
    seed = redis.RedisCluster.from_url(redis_cluster_url.replace("redis+cluster", "redis", 1))
    try:
        primaries = seed.get_primaries()
        slot = lambda name: int(seed.execute_command("CLUSTER KEYSLOT", name))  # noqa: E731
        slots = set()
        for k in keys:
            full = store.full_key(k)
            assert slot(conn._vkey(full)) == slot(conn._ckey(full))
            slots.add(slot(conn._vkey(full)))
        holding = 0
        for node in primaries:
            direct = redis.Redis(host=node.host, port=node.port)
            try:
                holding += bool(direct.keys(f"{conn.prefix}:v:{{{store.namespace}/*"))
            finally:
                direct.close()
    finally:
        seed.close()
    assert len(slots) > 40 and holding == len(primaries) == 3
    for got, want in zip(store.get_many(keys), records, strict=True):
        assert got is not None and got.key == want.key
        assert (got.embedding == want.embedding).all()
    assert store.delete(keys) == len(keys)
    assert store.exists_many(keys) == [False] * len(keys)
    assert store.stats()["shards"] == 3


# -- the budget ---------------------------------------------------------------------------------
def test_each_primary_holds_its_maxmemory(spawn_redis_cluster, open_cluster) -> None:
    """The budget is the shards' (each primary's maxmemory, allkeys-lru): 40 records of
    ~256 KiB over three primaries that hold ~1.5 MiB each beyond their own use; each stays
    within its maxmemory, evictions are counted, the newest records are held."""
    cluster = spawn_redis_cluster(masters=3, replicas=0, args=("--maxmemory-policy", "allkeys-lru"))
    room = 3 * 2**19
    for node in cluster.primaries():
        client = redis.Redis(port=node.port)
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + room)
        client.close()
    store = open_cluster(cluster.url)
    records = [make_record(rows=256, width=256, seed=i) for i in range(40)]  # ~256 KiB each
    for r in records:
        store.put_many([r])
    for node in cluster.primaries():
        memory = cluster.info(node, "memory")
        assert int(memory["used_memory"]) <= int(memory["maxmemory"]) * 1.05
    stats = store.stats()
    assert stats["shards"] == 3 and stats["evicted_keys"] > 0
    present = store.exists_many([r.key for r in records])
    assert all(present[-3:]) and sum(present) < len(records)


# -- failover -----------------------------------------------------------------------------------
class _Load:
    """Threads reading known records and claiming, publishing and reading new ones through one
    store, each answer checked: right, a miss of a new record's own publish, a retryable
    StoreUnavailableError, or anything else (counted apart: the test wants none)."""

    def __init__(self, store: EmbeddingStore, known: list, threads: int = 3) -> None:
        self.store, self.known = store, known
        self.ok = self.unavailable = self.wrong = 0
        self.other: list[BaseException] = []
        self.times: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _note(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)
            self.times.append((time.monotonic(), what))

    def _run(self, seed: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            want = self.known[(seed * 7919 + i) % len(self.known)]
            new = make_record(rows=4, width=16, seed=1_000_000 * (seed + 1) + i)
            try:
                got = self.store.get(want.key)
                right = got is not None and (got.embedding == want.embedding).all()
                [claim] = self.store.lookup_or_claim([new.key], 10.0)
                if claim is Claim.WON:
                    self.store.put_values(
                        [(new.key, encode_record(new))], release=[(new.key, self.store.token)]
                    )
                back = self.store.get(new.key)
                right = right and back is not None and (back.embedding == new.embedding).all()
                self._note("ok" if right else "wrong")
            except StoreUnavailableError:
                self._note("unavailable")
            except BaseException as exc:  # counted: the test asserts none
                with self._lock:
                    self.other.append(exc)

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def since(self, t: float, what: str = "ok") -> int:
        with self._lock:
            return sum(1 for at, w in self.times if at >= t and w == what)


def test_a_primary_killed_under_load_fails_over(
    spawn_redis_cluster, open_cluster, reliability
) -> None:
    """Three primaries with a replica each; three threads read, claim, publish and read back
    through one store while the primary of a known record is killed. Every answer is right or
    a retryable StoreUnavailableError during the election; then, nobody acting, the same store
    serves every slot again (the replica promoted), the known records there intact; the old
    primary, restarted, rejoins as a replica."""
    cluster = spawn_redis_cluster(masters=3, replicas=1)
    store = open_cluster(f"{cluster.url}?timeout_s=1&retries=1")
    known = [make_record(rows=8, width=32, seed=i) for i in range(60)]
    store.put_many(known)
    victim = cluster.primary_of(store.connection._vkey(store.full_key(known[0].key)))
    on_victim = [
        r for r in known
        if cluster.primary_of(store.connection._vkey(store.full_key(r.key))) is victim
    ]  # fmt: skip
    with _Load(store, known) as load:
        deadline = time.monotonic() + 30
        while load.ok < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        victim.kill()
        killed = time.monotonic()
        cluster.wait_healthy()
        healed = time.monotonic()
        while load.since(healed) < 30 and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        ended = time.monotonic()
    assert load.other == [] and load.wrong == 0, (load.other[:3], load.wrong)
    assert load.unavailable > 0, "the kill met no call: the test did not test a failover"
    assert load.since(healed) >= 30, "service did not come back"
    late = [w for at, w in load.times if at >= healed + 0.5]
    assert late.count("unavailable") == 0, late.count("unavailable")
    after = store.get_many([r.key for r in on_victim])
    lost = [r.key for g, r in zip(after, on_victim, strict=True) if g is None]
    assert all(
        g is None or (g.embedding == r.embedding).all()
        for g, r in zip(after, on_victim, strict=True)
    )
    assert lost == [], f"{len(lost)} of {len(on_victim)} records of the killed primary lost"
    cluster.restart(victim)
    cluster.wait_healthy()
    assert cluster.info(victim, "replication")["role"] == "slave"
    reliability.record(
        "Redis Cluster primary killed under load (3 primaries, 3 replicas)",
        tried=load.ok + load.unavailable + load.wrong,
        failed=load.unavailable,
        wrong=load.wrong,
        lost=len(lost),
        note=f"store calls: 3 threads; election {healed - killed:.1f} s; "
        f"{load.unavailable} retryable errors during it, none after; ran {ended - killed:.1f} s",
    )


# -- users --------------------------------------------------------------------------------------
def test_acl_users_on_a_cluster(spawn_redis_cluster, spawn_redis, open_cluster) -> None:
    """The users ``vitserve redis-acl`` writes, set on every node: the writer claims and
    publishes, the server side's reader reads every namespace, a tenant's reader its own only.
    What a user may not do, and refused credentials, are StoreErrors that are not retryable
    (trying again cannot help), as on one server; so is a seed node that is no cluster node."""
    cluster = spawn_redis_cluster(masters=3, replicas=0)
    users = {
        "w": writer_acl(cluster=True),
        "rd": server_reader_acl(cluster=True),
        "rd-a": reader_acl("t-a", cluster=True),
    }
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        for user, rules in users.items():
            client.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)
        client.close()
    port = cluster.nodes[0].port
    url = lambda user, ns: open_cluster(f"redis+cluster://{user}@127.0.0.1:{port}", namespace=ns)  # noqa: E731
    records = {ns: make_record(rows=6, width=8, seed=i) for i, ns in enumerate(("t-a", "t-b"))}
    for ns, record in records.items():
        writer = url("w:pw", ns)
        assert writer.lookup_or_claim([record.key], 10.0) == [Claim.WON]
        writer.put_values(
            [(record.key, encode_record(record))], release=[(record.key, writer.token)]
        )
        assert url("rd:pw", ns).get_rows(record.key, 1, 3) is not None
    tenant = url("rd-a:pw", "t-a")
    assert tenant.get(records["t-a"].key) is not None
    refused = [
        lambda: url("rd-a:pw", "t-b").get(records["t-b"].key),  # another tenant's record
        lambda: tenant.put_many([make_record(rows=2, width=8)]),  # a reader writes nothing
        lambda: url("w:wrong", "t-a").get(records["t-a"].key),  # refused credentials
    ]
    for call in refused:
        with pytest.raises(StoreError) as caught:
            call()
        assert not caught.value.retryable, caught.value
    plain = spawn_redis()
    with pytest.raises(StoreError, match="not in cluster mode") as caught:
        open_cluster(plain.url.replace("redis://", "redis+cluster://").removesuffix("/0")).get(
            new_key()
        )
    assert not caught.value.retryable


def test_a_tiered_store_over_the_cluster(open_cluster, redis_cluster_url: str) -> None:
    """``tiered://`` with a cluster as its shared tier: a write lands in both tiers, a read of
    a value only the cluster holds is promoted."""
    from urllib.parse import quote

    tiered = open_cluster(f"tiered://?l1=memory%3A%2F%2F&l2={quote(redis_cluster_url, safe='')}")
    shared = open_cluster(namespace=tiered.namespace)
    mine, theirs = make_record(rows=4, width=8, seed=1), make_record(rows=4, width=8, seed=2)
    tiered.put_many([mine])
    shared.put_many([theirs])
    assert shared.get(mine.key) is not None
    assert tiered.get(theirs.key) is not None
    assert tiered.connection.local.exists([tiered.full_key(theirs.key)]) == [True]


def test_a_cluster_on_tls_only(spawn_redis_cluster, open_cluster, tmp_path) -> None:
    """``rediss+cluster://`` against a cluster whose nodes speak TLS only (clients, the
    cluster bus, replication): a round trip, and a server certificate from a CA the client
    does not trust is a StoreError that is not retryable, naming the cause."""
    from tests.cache.test_redis_security import _certificates

    certs = _certificates(tmp_path)
    cluster = spawn_redis_cluster(masters=3, replicas=1, tls=certs)
    assert cluster.url.startswith("rediss+cluster://")
    store = open_cluster(f"{cluster.url}?{cluster.url_options}")
    record = make_record(rows=16, width=8, seed=3)
    assert store.lookup_or_claim([record.key], 10.0) == [Claim.WON]
    store.put_values([(record.key, encode_record(record))], release=[(record.key, store.token)])
    got = store.get_rows(record.key, 4, 12)
    assert got is not None and (got.embedding == record.embedding[4:12]).all()
    untrusted = open_cluster(f"{cluster.url}?ssl_ca_certs={certs['other-ca']}&timeout_s=2")
    with pytest.raises(StoreError, match="not trusted") as caught:
        untrusted.get(record.key)
    assert not caught.value.retryable
