"""RedisStore against real redis-servers: what only Redis does (the cross-store contract is
test_conformance.py). Row ranges move only their blocks, a dead, killed or stopped server is a
StoreUnavailableError within the timeout and the pool recovers, claims across replicas, corrupt
values are dropped, and the server's maxmemory LRU is the byte budget.

Private servers come from the ``spawn_redis`` fixture of ``tests/cache/conftest.py``.
"""

from __future__ import annotations

import signal
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from vitserve.cache.codec import (
    FORMAT_VERSION,
    MAIN,
    EmbeddingRecord,
    encode_record,
    read_header,
    row_spans,
)
from vitserve.cache.redis_store import HEAD_READ, RedisStore
from vitserve.errors import StoreUnavailableError
from vitserve.testing.records import make_record, new_key


def _same(got: EmbeddingRecord | None, want: EmbeddingRecord, rows: slice = slice(None)) -> None:
    assert got is not None
    assert set(got.tensors) == set(want.tensors)
    for name, array in want.tensors.items():
        assert got.tensors[name].dtype == array.dtype
        assert np.array_equal(got.tensors[name], array[rows])


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture
def open_redis(redis_url: str) -> Iterator[Callable[..., RedisStore]]:
    """Opens RedisStores (on the suite's server unless ``url`` is given), closed at teardown;
    each call gets a fresh namespace unless one is given."""
    opened: list[RedisStore] = []

    def open_(url: str | None = None, *, namespace: str | None = None, **kw) -> RedisStore:
        ns = namespace if namespace is not None else uuid.uuid4().hex[:12]
        opened.append(RedisStore(url or redis_url, namespace=ns, **kw))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def _vkey(store: RedisStore, key: str) -> str:
    return f"{store.connection.prefix}:v:{store.full_key(key)}"


def _ckey(store: RedisStore, key: str) -> str:
    return f"{store.connection.prefix}:c:{store.full_key(key)}"


# -- layout, buffers, TTL ----------------------------------------------------------------------
def test_smoke_layout_buffers_and_ttl(open_redis, raw: redis.Redis) -> None:
    store = open_redis()
    records = [
        make_record(rows=50, width=64, dtype=d, extras=e, seed=i)
        for i, (d, e) in enumerate([("fp32", 0), ("fp16", 2), ("bf16", 1)])
    ]
    store.put_many(records[:1])
    # already-encoded values in every buffer kind the publish path hands over
    encoded = encode_record(records[1])
    as_array = np.frombuffer(encode_record(records[2]), dtype=np.uint8)
    store.put_values([(records[1].key, encoded), (records[2].key, as_array)], ttl_s=30)
    got = store.get_many([r.key for r in records] + [new_key()])
    for g, r in zip(got, records, strict=False):
        _same(g, r)
        emb = g.embedding
        assert not emb.flags.writeable and not emb.flags.owndata
        while isinstance(emb, np.ndarray):
            emb = emb.base
        assert isinstance(emb, bytes)  # a view of the bytes redis-py read: no copy
    assert got[3] is None
    # the key layout, and TTL as Redis's own PX (none when no ttl is given)
    assert raw.get(f"vsm:v:{store.namespace}/{records[1].key}") == bytes(encoded)
    assert raw.pttl(_vkey(store, records[0].key)) == -1
    assert 25_000 < raw.pttl(_vkey(store, records[1].key)) <= 30_000
    short = open_redis(ttl_s=0.2)
    short.put_many(records[:1])
    assert 0 < raw.pttl(_vkey(short, records[0].key)) <= 200
    time.sleep(0.3)
    assert short.get(records[0].key) is None and short.exists_many([records[0].key]) == [False]
    assert store.delete([r.key for r in records]) == 3
    assert store.exists_many([r.key for r in records]) == [False] * 3
    assert {"used_memory", "maxmemory", "evicted_keys", "expired_keys"} <= set(store.stats())


# -- row ranges --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "rows"),
    [("fp16", 8192), ("fp32", 4096), ("bf16", 8192)],  # 16 MiB of payload each
)
def test_row_range_reads_only_the_needed_blocks(
    open_redis, raw: redis.Redis, dtype: str, rows: int
) -> None:
    store = open_redis()
    record = make_record(rows=rows, width=1024, dtype=dtype, seed=rows)
    value = encode_record(record)
    store.put_values([(record.key, value)])
    header = read_header(value)
    payload = header.payload_bytes
    r0, r1 = 1000, 1064  # crosses a block boundary: two blocks of the one tensor
    [span] = row_spans(header, r0, r1)
    [t] = header.tensors
    row_bytes = t.row_bytes(header.itemsize)
    assert (span.end_row - span.first_row) <= (r1 - r0) + 2 * t.block_rows

    before = store.stats()["bytes_fetched"]
    out_before = raw.info("stats")["total_net_output_bytes"]
    part = store.get_rows(record.key, r0, r1)
    out_after = raw.info("stats")["total_net_output_bytes"]
    fetched = store.stats()["bytes_fetched"] - before

    _same(part, record, slice(r0, r1))
    assert part.row_start == r0
    assert fetched == (span.end_row - span.first_row) * row_bytes
    assert fetched < 0.05 * payload
    # the server agrees: it sent the header read and the two blocks, not the value
    assert out_after - out_before < 0.05 * payload

    out_before = raw.info("stats")["total_net_output_bytes"]
    _same(store.get(record.key), record)
    assert raw.info("stats")["total_net_output_bytes"] - out_before >= payload  # counter works


def test_row_range_of_a_header_longer_than_the_first_read(open_redis) -> None:
    store = open_redis()
    record = make_record(rows=40, width=8, dtype="fp16", extras=90, seed=5)
    value = encode_record(record)
    assert read_header(value).payload_offset > HEAD_READ  # the head takes a second GETRANGE
    store.put_values([(record.key, value)])
    _same(store.get_rows(record.key, 7, 31), record, slice(7, 31))
    assert store.stats()["integrity_misses"] == 0


def test_row_range_of_a_vanished_value_is_a_plain_miss(open_redis) -> None:
    store = open_redis()
    assert store.get_rows(new_key(), 0, 1) is None
    stats = store.stats()
    assert (stats["misses"], stats["integrity_misses"]) == (1, 0)


# -- an unreachable server ---------------------------------------------------------------------
def _every_operation(store: RedisStore) -> dict[str, Callable[[], object]]:
    key, record = new_key(), make_record(rows=512, width=1024, dtype="fp16")  # 1 MiB
    return {
        "get_many": lambda: store.get_many([key, new_key()]),
        "put_many": lambda: store.put_many([record]),
        "exists_many": lambda: store.exists_many([key]),
        "get_rows": lambda: store.get_rows(key, 0, 4),
        "claim": lambda: store.claim(key, ttl_s=5),
        "release": lambda: store.release(key),
        "wait_for": lambda: store.wait_for(key, timeout_s=0.1),
        "delete": lambda: store.delete(key),
    }


def _assert_unavailable(store: RedisStore, call: Callable[[], object], limit_s: float) -> float:
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < limit_s
    assert info.value.retryable and info.value.store == store.connection.name
    return elapsed


def test_nothing_listening_fails_fast_on_every_operation(
    spawn_redis, open_redis, monkeypatch
) -> None:
    server = spawn_redis()
    server.kill()  # a free port where nothing listens
    store = open_redis(server.url, timeout_s=0.5)
    assert store.connection.name == f"redis 127.0.0.1:{server.port}/0"
    ops = _every_operation(store)
    for call in ops.values():
        _assert_unavailable(store, call, limit_s=store.connection.timeout_s + 1)
    assert store.stats()["errors"] == len(ops)
    # stats() never fails for want of INFO, and does not ask again right after a failure
    pipelines = []
    real_pipeline = store.connection._client.pipeline
    monkeypatch.setattr(
        store.connection._client,
        "pipeline",
        lambda *a, **k: pipelines.append(1) or real_pipeline(*a, **k),
    )
    stats = store.stats()
    assert "used_memory" not in stats and "errors" in stats
    assert pipelines == []  # INFO failed just above (in the errors check): not asked again


def test_killed_server_fails_within_the_timeout_and_the_pool_recovers(
    spawn_redis, open_redis
) -> None:
    server = spawn_redis()
    store = open_redis(server.url, timeout_s=1.0)
    record = make_record(seed=1)
    store.put_many([record])
    _same(store.get(record.key), record)
    assert store.claim(record.key, ttl_s=10)  # loads the release script on this server

    server.kill()  # SIGKILL: the pooled connections are dead
    for call in _every_operation(store).values():
        _assert_unavailable(store, call, limit_s=store.connection.timeout_s + 1)

    server.start()  # same port, empty (no persistence)
    assert store.get(record.key) is None
    store.put_many([record])
    _same(store.get_rows(record.key, 3, 9), record, slice(3, 9))
    assert store.claim(record.key, ttl_s=10)
    store.release(record.key)  # the release script is reloaded into the new server
    assert store.claim(record.key, ttl_s=10)


def test_stopped_server_times_out_instead_of_hanging(spawn_redis, open_redis) -> None:
    server = spawn_redis()
    pooled = open_redis(server.url, timeout_s=0.5)
    record = make_record(seed=2)
    pooled.put_many([record])  # this one holds a live pooled connection
    # and this one must connect to the stopped server
    fresh = open_redis(server.url, namespace=pooled.namespace, timeout_s=0.5)
    server.proc.send_signal(signal.SIGSTOP)  # accepts TCP (kernel backlog) but never answers
    try:
        elapsed = [
            _assert_unavailable(store, call, limit_s=store.connection.timeout_s + 1)
            for store in (pooled, fresh)
            for name, call in _every_operation(store).items()
            if name in ("get_many", "put_many", "get_rows", "claim")
        ]
        assert min(elapsed) >= 0.4  # it did wait for the server, about timeout_s
    finally:
        server.proc.send_signal(signal.SIGCONT)
    _same(pooled.get(record.key), record)  # timed-out connections were dropped, not reused
    _same(fresh.get(record.key), record)


# -- claims across replicas --------------------------------------------------------------------
def _in_thread(fn: Callable[[], bool]) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box["result"] = fn()
        box["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_claims_across_two_replicas(open_redis, raw: redis.Redis) -> None:
    winner = open_redis()
    loser = open_redis(namespace=winner.namespace)  # its own pool, as another replica
    record = make_record(seed=3)
    key = record.key

    # one wins; the loser's wait_for sees the publish promptly
    assert winner.claim(key, ttl_s=10)
    assert not loser.claim(key, ttl_s=10)
    wait_s = 5.0  # every wake-up below comes well before it: the event woke the waiter
    thread, box = _in_thread(lambda: loser.wait_for(key, timeout_s=wait_s))
    time.sleep(0.2)
    winner.put_many([record])
    put_at = time.monotonic()
    winner.release(key)
    thread.join()
    assert box["result"] is True and box["at"] - put_at < wait_s / 4
    assert raw.exists(_ckey(winner, key)) == 0

    # nobody publishes: False after the timeout
    quiet = new_key()
    assert winner.claim(quiet, ttl_s=10)
    start = time.monotonic()
    assert loser.wait_for(quiet, timeout_s=0.3) is False
    assert 0.3 <= time.monotonic() - start < 4 * 0.3  # at its timeout, not a multiple of it

    # the winner gives up without publishing: False early
    thread, box = _in_thread(lambda: loser.wait_for(quiet, timeout_s=wait_s))
    time.sleep(0.2)
    winner.release(quiet)
    released_at = time.monotonic()
    thread.join()
    assert box["result"] is False and box["at"] - released_at < wait_s / 4

    # a non-owner's release leaves the owner's claim alone
    held = new_key()
    assert winner.claim(held, ttl_s=10)
    claim_value = raw.get(_ckey(winner, held))
    loser.release(held)
    assert raw.get(_ckey(winner, held)) == claim_value
    assert not loser.claim(held, ttl_s=10)
    winner.release(held)
    assert loser.claim(held, ttl_s=10)

    # a claim ends with its ttl (a crashed claimant blocks nobody for long)
    short = new_key()
    assert winner.claim(short, ttl_s=0.2)
    assert 0 < raw.pttl(_ckey(winner, short)) <= 200
    assert not loser.claim(short, ttl_s=10)
    time.sleep(0.3)
    assert loser.claim(short, ttl_s=10)


# -- integrity ---------------------------------------------------------------------------------
def _corrupt(case: str, raw: redis.Redis, vkey: str, value: bytes, other: bytes) -> None:
    payload_offset = read_header(value).payload_offset
    if case == "payload_byte":
        pos = payload_offset + 100
        raw.setrange(vkey, pos, bytes([value[pos] ^ 0x01]))
    elif case == "truncated":
        raw.set(vkey, value[:-64])
    elif case == "other_key":
        raw.set(vkey, other)
    elif case == "garbage":
        raw.set(vkey, b"not a record " * 20)
    elif case == "tiny":
        raw.set(vkey, b"VSEM")
    elif case == "version":
        raw.setrange(vkey, 4, struct.pack("<H", FORMAT_VERSION + 1))
    elif case == "header_len":  # the prefix claims a header far longer than the value
        raw.setrange(vkey, 8, struct.pack("<I", 10**8))
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("via", ["get", "get_rows"])
@pytest.mark.parametrize(
    "case", ["payload_byte", "truncated", "other_key", "garbage", "tiny", "version", "header_len"]
)
def test_corrupt_values_are_misses_and_dropped(
    open_redis, raw: redis.Redis, case: str, via: str
) -> None:
    store = open_redis()
    record, other = make_record(rows=64, width=256, dtype="fp16", seed=4), make_record(seed=5)
    value = bytes(encode_record(record))
    store.put_values([(record.key, value)])
    vkey = _vkey(store, record.key)
    _corrupt(case, raw, vkey, value, bytes(encode_record(other)))

    before = store.stats()
    got = store.get(record.key) if via == "get" else store.get_rows(record.key, 0, 64)
    after = store.stats()

    assert got is None
    assert after["integrity_misses"] - before["integrity_misses"] == 1
    assert after["misses"] - before["misses"] == 1
    assert after["hits"] == before["hits"] and after["errors"] == before["errors"] == 0
    if case == "version":  # written by a newer vitserve: a miss here, but kept for newer readers
        assert raw.exists(vkey) == 1
    else:
        assert raw.exists(vkey) == 0  # dropped, so that it is recomputed
    store.put_many([record])
    _same(store.get(record.key), record)


def test_payload_checksum_is_verified_on_every_read(open_redis, raw: redis.Redis) -> None:
    """A flipped byte in a block outside the rows read leaves those rows valid."""
    store = open_redis()
    record = make_record(rows=1024, width=1024, dtype="fp16", seed=6)  # 64 blocks of 16 rows
    value = bytes(encode_record(record))
    store.put_values([(record.key, value)])
    header = read_header(value)
    [t] = header.tensors
    row_bytes = t.row_bytes(header.itemsize)
    assert t.name == MAIN and t.block_rows == 16
    pos = header.payload_offset + 900 * row_bytes  # in block 56
    raw.setrange(_vkey(store, record.key), pos, bytes([value[pos] ^ 0x80]))
    _same(store.get_rows(record.key, 0, 100), record, slice(0, 100))  # blocks 0-6 are intact
    assert store.get_rows(record.key, 890, 910) is None  # block 56 is not
    assert store.stats()["integrity_misses"] == 1
    assert store.get(record.key) is None  # dropped


# -- the server's byte budget ------------------------------------------------------------------
def test_maxmemory_lru_is_the_byte_budget(spawn_redis, open_redis) -> None:
    server = spawn_redis("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    store = open_redis(server.url)
    limit = 4 * 2**20
    records = [make_record(rows=256, width=1024, dtype="fp16", seed=i) for i in range(40)]
    peak = 0
    for record in records:  # 512 KiB each, 20 MiB in all
        store.put_many([record])
        peak = max(peak, store.stats()["used_memory"])
    stats = store.stats()
    assert stats["maxmemory"] == limit
    # Redis evicts before each write, so it may sit one value (and a query buffer) above
    assert peak <= limit + 2**19, peak
    assert stats["evicted_keys"] >= 30
    got = store.get_many([r.key for r in records])
    assert got[:20] == [None] * 20  # the first ones went
    for g, r in zip(got[-2:], records[-2:], strict=True):  # the last ones stayed
        _same(g, r)
    after = store.stats()
    assert after["integrity_misses"] == 0  # evicted values are plain misses
