"""Tenants' byte shares in the stores that take them: the in-process LRU (``memory://``, as the
node store's actor runs it) and Redis with vitserve's ledger (``redis://...?max_bytes=...
&share_bytes=...``), each connection given the same writes: a namespace's entries up to its
share are never evicted by another's writes, a namespace over its share evicts its own first,
room no one uses can be borrowed, and a put that cannot be made room for within the shares is
refused (counted), never made by evicting someone's share.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from vitserve.cache.connection import Connection
from vitserve.cache.memory import MemoryConnection
from vitserve.cache.redis_store import RedisConnection
from vitserve.cache.urls import open_connection

MAX, SHARE, SIZE = 100, 40, 10


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., Connection]]:
    opened: list[Connection] = []
    prefix = f"shares-{uuid.uuid4().hex[:8]}"

    def make(max_bytes: int = MAX, share_bytes: int | None = SHARE) -> Connection:
        if request.param == "memory":
            conn: Connection = MemoryConnection(max_bytes=max_bytes, share_bytes=share_bytes)
        else:
            url = request.getfixturevalue("redis_url")
            conn = RedisConnection(url, prefix=prefix, max_bytes=max_bytes, share_bytes=share_bytes)
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.close()


def _put(conn: Connection, ns: str, i: int, size: int = SIZE, ttl_s: float | None = None) -> None:
    conn.put_values([(f"{ns}/{i}", bytes([i % 256]) * size)], ttl_s)


def _held(conn: Connection, ns: str, n: int) -> list[bool]:
    return conn.exists([f"{ns}/{i}" for i in range(n)])


def test_another_namespaces_writes_never_take_one_below_its_share(connect) -> None:
    conn = connect()
    for i in range(4):
        _put(conn, "a", i)  # a: its whole share
    for i in range(50):  # b writes five times the budget, one value at a time
        _put(conn, "b", i)
    assert _held(conn, "a", 4) == [True] * 4
    b = _held(conn, "b", 50)
    assert sum(b) == 6 and b[-6:] == [True] * 6  # b evicted its own, oldest first


def test_a_batch_put_obeys_the_shares_too(connect) -> None:
    conn = connect()
    for i in range(4):
        _put(conn, "a", i)
    conn.put_values([(f"b/{i}", b"x" * SIZE) for i in range(20)], None)
    assert _held(conn, "a", 4) == [True] * 4 and sum(_held(conn, "b", 20)) == 6


def test_room_no_one_uses_is_borrowed_and_taken_back(connect) -> None:
    conn = connect()
    for i in range(9):
        _put(conn, "a", i)
    assert sum(_held(conn, "a", 9)) == 9  # 90 of 100: a borrows
    for i in range(6):
        _put(conn, "b", i)
    assert _held(conn, "a", 9) == [False] * 5 + [True] * 4  # back to its share, oldest out
    assert sum(_held(conn, "b", 6)) == 6


def test_a_put_with_no_room_within_the_shares_is_refused_and_counted(connect) -> None:
    conn = connect(max_bytes=60)  # smaller than the shares: everyone within them fills it
    for i in range(3):
        _put(conn, "a", i)
        _put(conn, "b", i)
    _put(conn, "c", 0)
    assert _held(conn, "c", 1) == [False]
    assert _held(conn, "a", 3) == [True] * 3 and _held(conn, "b", 3) == [True] * 3
    stats = conn.stats()  # this connection's refusal; Redis's ledger counts it server-wide too
    assert stats["over_share"] == 1 and stats.get("ledger_refused", 1) == 1, stats
    _put(conn, "a", 3)  # a's own entries make room for a
    assert _held(conn, "a", 4) == [False, True, True, True]


def test_deleted_and_replaced_values_leave_the_accounts(connect) -> None:
    conn = connect()
    for i in range(4):
        _put(conn, "a", i)
    assert conn.delete(["a/0", "a/1"]) == 2
    _put(conn, "a", 2, size=5)  # replaced by a smaller value
    for i in range(20):
        _put(conn, "b", i)
    # a holds 2/5 + 3/10 = 15 bytes, below its share: none of it is evicted, b has 85
    assert _held(conn, "a", 4) == [False, False, True, True]
    assert sum(_held(conn, "b", 20)) == 8


def test_redis_entries_gone_by_ttl_leave_the_ledger(redis_url) -> None:
    conn = RedisConnection(
        redis_url, prefix=f"shares-{uuid.uuid4().hex[:8]}", max_bytes=MAX, share_bytes=SHARE
    )
    try:
        for i in range(4):
            _put(conn, "a", i, ttl_s=0.05)  # a's share, expiring at once
        for i in range(4):
            _put(conn, "a", 10 + i)  # a again, its live entries
        time.sleep(0.1)
        for i in range(20):
            _put(conn, "b", i)
        # the 4 expired ones no longer count: a holds 40 live bytes, its share, all kept
        assert conn.exists([f"a/{10 + i}" for i in range(4)]) == [True] * 4
        assert sum(_held(conn, "b", 20)) == 6
        assert conn.stats()["ledger_bytes"] == 100
    finally:
        conn.close()


def test_the_redis_url_takes_the_budget_and_the_shares(redis_url) -> None:
    conn, _ = open_connection(f"{redis_url}?max_bytes=1MiB&share_bytes=256KiB&prefix=u")
    try:
        assert isinstance(conn, RedisConnection)
        assert (conn.max_bytes, conn.share_bytes) == (2**20, 2**18)
    finally:
        conn.close()


def test_without_max_bytes_redis_keeps_no_ledger(redis_url) -> None:
    prefix = f"shares-{uuid.uuid4().hex[:8]}"
    conn = RedisConnection(redis_url, prefix=prefix)
    try:
        _put(conn, "a", 0)
        client = redis.Redis.from_url(redis_url)
        assert client.keys(f"{prefix}:q:*") == []
        client.close()
    finally:
        conn.close()


@pytest.mark.slow
def test_redis_shares_match_the_lru_under_any_sequence(redis_url) -> None:
    """Property: the Redis ledger keeps every namespace at or above its share against the
    others' writes, and its byte counts match the values held, whatever the sequence."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(
        st.tuples(st.sampled_from(["put", "pop"]), st.sampled_from("abc"), st.integers(0, 7),
                  st.integers(1, 30)),
        max_size=40,
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)

    @settings(max_examples=60, deadline=None)
    @given(ops)
    def check(sequence: list[tuple[str, str, int, int]]) -> None:
        prefix = f"prop-{uuid.uuid4().hex[:8]}"
        conn = RedisConnection(redis_url, prefix=prefix, max_bytes=MAX, share_bytes=SHARE)
        try:
            for op, ns, i, size in sequence:
                if op == "pop":
                    conn.delete([f"{ns}/{i}"])
                    continue
                before = {n: _bytes(client, prefix, n) for n in "abc"}
                conn.put_values([(f"{ns}/{i}", b"x" * size)], None)
                total = sum(_bytes(client, prefix, n) for n in "abc")
                assert total <= MAX and total == int(client.get(f"{prefix}:q:t") or 0)
                for other in set("abc") - {ns}:
                    now = _bytes(client, prefix, other)
                    assert now >= before[other] or now >= SHARE, (other, before, now)
        finally:
            conn.close()

    try:
        check()
    finally:
        client.close()


def _bytes(client: redis.Redis, prefix: str, ns: str) -> int:
    """The bytes of ``ns``'s values held in Redis (read from the values, not the ledger)."""
    keys = client.keys(f"{prefix}:v:{ns}/*")
    return sum(client.strlen(k) for k in keys)


@pytest.mark.parametrize("ledger", [True, False])
def test_the_writer_acl_of_a_budgeted_store_lets_it_keep_its_ledger(redis_url, ledger) -> None:
    """A writer user with ``writer_acl(ledger=True)`` (what ``vitserve redis-acl`` grants when the
    store keeps its budget in Redis) puts, evicts and deletes through the ledger; the plain
    writer's rules are refused (NOPERM) the moment the ledger's Lua runs."""
    from urllib.parse import urlsplit, urlunsplit

    from vitserve.cache.redis_acl import writer_acl
    from vitserve.errors import StoreError

    prefix = f"acl-{uuid.uuid4().hex[:8]}"
    user, password = f"ledger-writer-{uuid.uuid4().hex[:8]}", "pw-0123456789"
    admin = redis.Redis.from_url(redis_url)
    admin.acl_setuser(user, enabled=True, reset=True)  # then the manifest's words, as given
    # +select: the suite's Redis is db 15 (the manifests' stores use db 0, no SELECT)
    rules = (*writer_acl(prefix, ledger), "+select")
    admin.execute_command("ACL", "SETUSER", user, f">{password}", *rules)
    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.netloc}"))
    conn = RedisConnection(url, prefix=prefix, max_bytes=MAX, share_bytes=SHARE)
    try:
        if not ledger:
            with pytest.raises(StoreError, match="may not run") as refused:
                _put(conn, "a", 0)
            assert "select" not in str(refused.value)  # refused inside the ledger's Lua
            return
        for i in range(4):
            _put(conn, "a", i)
        for i in range(20):
            _put(conn, "b", i)
        assert _held(conn, "a", 4) == [True] * 4 and sum(_held(conn, "b", 20)) == 6
        assert conn.delete(["a/0"]) == 1
    finally:
        conn.close()
        admin.acl_deluser(user)
        admin.close()
