"""One conformance suite, run against every store: in-process, node-local (a real Ray cluster),
Redis (a real redis-server) and tiered (in-process in front of Redis)."""

from __future__ import annotations

import struct
import threading
import time

import numpy as np
import pytest

from vitserve.cache.codec import PREFIX, encode_record
from vitserve.errors import ConfigError
from vitserve.testing.records import make_record, new_key


def _assert_same(got, want, rows: slice = slice(None)) -> None:
    assert got is not None
    assert got.key == want.key and got.dtype == want.dtype and got.num_tokens == want.num_tokens
    assert got.grid == want.grid
    assert set(got.tensors) == set(want.tensors)
    for name, array in want.tensors.items():
        assert got.tensors[name].dtype == array.dtype
        assert np.array_equal(got.tensors[name], array[rows])
        assert not got.tensors[name].flags.writeable


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_every_dtype(make_store, dtype: str) -> None:
    store = make_store()
    records = [
        make_record(rows=r, width=48, dtype=dtype, extras=e, seed=r)
        for r, e in [(1, 0), (77, 0), (300, 3)]
    ]
    store.put_many(records)
    got = store.get_many([r.key for r in records])
    for g, r in zip(got, records, strict=True):
        _assert_same(g, r)
    assert store.exists_many([r.key for r in records]) == [True] * 3
    assert store.stats()["hits"] >= 3


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_row_ranges(make_store, dtype: str) -> None:
    store = make_store()
    # wide rows: a checksum block holds few rows, so ranges cross block boundaries
    record = make_record(rows=1000, width=4096, dtype=dtype, extras=2, seed=3)
    store.put_many([record])
    for r0, r1 in [(0, 1), (0, 1000), (17, 18), (15, 49), (990, 1000), (128, 640)]:
        part = store.get_rows(record.key, r0, r1)
        assert part.row_start == r0
        _assert_same(part, record, slice(r0, r1))
    with pytest.raises(ConfigError):
        store.get_rows(record.key, 10, 10)
    with pytest.raises(ConfigError):
        store.get_rows(record.key, 0, 1001)


def test_row_ranges_of_several_keys_at_once(make_store) -> None:
    """``get_rows_many``: every range right, misses as None, a cached header saves the head
    read, and a stale cached header (the key re-encoded since) costs a re-read, never wrong
    rows and never the value."""
    store = make_store()
    a, b = (make_record(rows=200, width=256, extras=1, seed=s) for s in (21, 22))
    store.put_many([a, b])
    absent = new_key()
    reads = [(a.key, 5, 40), (b.key, 150, 200), (absent, 0, 1), (a.key, 100, 101)]
    headers: dict = {}
    got = store.get_rows_many(reads, headers)
    _assert_same(got[0], a, slice(5, 40))
    _assert_same(got[1], b, slice(150, 200))
    assert got[2] is None
    _assert_same(got[3], a, slice(100, 101))
    assert set(headers) == {a.key, b.key}

    # with the headers cached, a remote store reads only the rows' blocks (a store holding
    # whole values reads the value's own header too, from memory)
    before = store.stats()["bytes_read"]
    _assert_same(store.get_rows_many([(a.key, 5, 40)], headers)[0], a, slice(5, 40))
    [t, _] = headers[a.key].tensors
    blocks = -(-40 // t.block_rows) * t.block_rows  # rows 0..40 widened to whole blocks
    head = headers[a.key].payload_offset if store.head_is_whole_value else 0
    assert store.stats()["bytes_read"] - before == head + 2 * blocks * 256 * 4  # 2 fp32 tensors

    # the same key re-encoded with other values: the cached header no longer matches
    changed = make_record(rows=200, width=256, extras=1, seed=23, key=a.key)
    store.put_many([changed])
    stale = store.stats()
    _assert_same(store.get_rows_many([(a.key, 5, 40)], headers)[0], changed, slice(5, 40))
    after = store.stats()
    assert after["integrity_misses"] == stale["integrity_misses"]
    if not store.head_is_whole_value:  # (the others never use a cached header)
        assert after.get("stale_headers", 0) == stale.get("stale_headers", 0) + 1
    assert store.exists_many([a.key]) == [True]  # not dropped as corrupt


def test_misses(make_store) -> None:
    store = make_store()
    present = make_record()
    store.put_many([present])
    absent = new_key()
    got = store.get_many([absent, present.key, absent])
    assert got[0] is None and got[2] is None
    _assert_same(got[1], present)
    assert store.exists_many([absent, present.key]) == [False, True]
    assert store.get_rows(absent, 0, 1) is None
    assert store.stats()["misses"] >= 3
    assert store.delete([present.key, absent]) == 1
    assert store.get(present.key) is None


def test_ttl_expiry(make_store) -> None:
    store = make_store()
    short, default = make_record(seed=1), make_record(seed=2)
    store.put_many([short], ttl_s=0.4)
    store.put_many([default])
    assert store.exists_many([short.key, default.key]) == [True, True]
    time.sleep(0.8)
    assert store.exists_many([short.key, default.key]) == [False, True]
    assert store.get(short.key) is None
    timed = make_store(ttl_s=0.4)
    rec = make_record(seed=3)
    timed.put_many([rec])
    time.sleep(0.8)
    assert timed.get(rec.key) is None


def test_lru_eviction_holds_the_byte_budget(make_store) -> None:
    budget = 4 * 2**20
    store = make_store(max_bytes=budget)
    records = [make_record(rows=256, width=256, seed=i) for i in range(40)]  # ~256 KiB each
    fits = budget // len(encode_record(records[0]))
    for r in records[:8]:
        store.put_many([r])
    store.get_many([records[0].key])  # touch the oldest: now the most recently used
    for r in records[8 : fits + 1]:
        store.put_many([r])  # one more than fits: the least recently used goes
    exact = store.kind != "redis"  # Redis samples keys for its LRU: approximate

    def held(recs: list) -> list[bool]:
        # A tiered store's budget is its local tier's (the shared tier still serves evictees).
        if store.kind == "tiered":
            return store.connection.local.exists([store.full_key(r.key) for r in recs])
        return store.exists_many([r.key for r in recs])

    if exact:
        assert held(records[:2]) == [True, False]
    for r in records[fits + 1 :]:
        store.put_many([r])
    present = held(records)
    assert sum(present) <= fits
    assert all(present[-4:]), "the newest entries are held"
    stats = store.stats()
    if exact:
        assert stats.get("local_bytes", stats.get("bytes")) <= budget
        assert stats.get("local_evictions", stats["evictions"]) >= len(records) - fits
    else:
        assert stats["used_memory"] <= budget * 1.1
        assert sum(present[:20]) < sum(present[20:])


def test_claims_single_flight(make_store) -> None:
    a = make_store()
    b = make_store.peer(a)
    record = make_record(seed=5)
    assert a.claim(record.key, ttl_s=10)
    assert not b.claim(record.key, ttl_s=10)

    waited: dict[str, float | bool] = {}

    wait_s = 10.0

    def waiter() -> None:
        waited["result"] = b.wait_for(record.key, timeout_s=wait_s)
        waited["at"] = time.monotonic()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    assert "result" not in waited  # still waiting for the winner
    published = time.monotonic()
    a.put_many([record])
    a.release(record.key)
    thread.join(timeout=10)
    assert waited["result"] is True
    assert waited["at"] - published < wait_s / 4  # woken by the publish, not its timeout
    _assert_same(b.get(record.key), record)


def test_wait_for_times_out_cleanly_and_sees_released_claims(make_store) -> None:
    a = make_store()
    b = make_store.peer(a)
    key = new_key()
    assert a.claim(key, ttl_s=10)
    start = time.monotonic()
    assert b.wait_for(key, timeout_s=0.5) is False
    assert 0.45 <= time.monotonic() - start < 4 * 0.5  # at its timeout, not a multiple of it
    # the winner gives up without publishing: the waiter returns early, False
    threading.Timer(0.2, a.release, args=(key,)).start()
    start = time.monotonic()
    assert b.wait_for(key, timeout_s=10) is False
    assert time.monotonic() - start < 10 / 4  # woken by the release, not its timeout
    assert b.claim(key, ttl_s=0.3)  # now free; and a claim expires on its own
    time.sleep(0.6)
    assert a.claim(key, ttl_s=5)


def test_a_record_read_waits_for_a_claimed_keys_publish_and_not_for_a_free_key(make_store) -> None:
    """The encoder answers while its publish is under way, under the image's claim: a record read
    that misses a claimed key waits for the publish; a free key is a miss at once; a claim
    released without a value ends the wait at once; ``read_wait_s=0`` does not wait."""
    import dataclasses

    from vitserve.cache.base import EmbeddingStore

    reader = make_store()
    writer = make_store.peer(reader)
    record, later, free, abandoned = (
        make_record(rows=6, seed=51),
        make_record(seed=52),
        new_key(),
        new_key(),
    )
    for key in (record.key, later.key, abandoned):
        assert writer.claim(key, ttl_s=10, token="encoder")

    def publish(r) -> None:
        writer.put_values([(r.key, encode_record(r))], release=[(r.key, "encoder")])

    threading.Timer(0.3, publish, args=(record,)).start()
    start = time.monotonic()
    [rows] = reader.get_rows_many([(record.key, 1, 4)])
    assert 0.25 <= time.monotonic() - start < 4  # woken by the publish
    _assert_same(rows, record, slice(1, 4))
    start = time.monotonic()
    assert reader.get(free) is None and reader.get_rows_many([(free, 0, 1)]) == [None]
    assert time.monotonic() - start < 1  # nobody's claim: no wait
    threading.Timer(0.3, writer.release, args=(abandoned, "encoder")).start()
    start = time.monotonic()
    assert reader.get_value(abandoned) is None
    assert time.monotonic() - start < 4  # the claim went without a value: not its ttl
    waits = reader.stats()["read_waits"]
    assert waits == 2  # the published key and the abandoned one; not the free one

    hasty = EmbeddingStore(reader.connection, dataclasses.replace(reader.policy, read_wait_s=0))
    start = time.monotonic()
    assert hasty.get(later.key) is None and time.monotonic() - start < 1
    threading.Timer(0.3, publish, args=(later,)).start()
    _assert_same(reader.get_many([later.key])[0], later)  # get_many waits too
    assert reader.stats()["read_waits"] == waits + 1


def test_lookup_or_claim_answers_headers_or_claims_and_publish_releases(make_store) -> None:
    from vitserve.cache.base import Claim

    ingress = make_store()
    encoder = make_store.peer(ingress)  # another replica: another token
    held, new, busy = make_record(rows=5, seed=31), make_record(rows=6, seed=32), new_key()
    ingress.put_many([held])
    assert encoder.claim(busy, ttl_s=10)
    answers = ingress.lookup_or_claim([held.key, new.key, busy], ttl_s=10, token="req-1")
    assert answers[0].num_tokens == 5 and answers[0].key == held.key
    assert answers[1:] == [Claim.WON, Claim.BUSY]
    # the claim is the token's: another token is refused, a wrong release changes nothing
    assert ingress.lookup_or_claim([new.key], ttl_s=10, token="req-2") == [Claim.BUSY]
    encoder.release(new.key, token="req-2")
    assert not encoder.claim(new.key, ttl_s=10)
    # the publisher (another store object) releases the ingress's claim with the value
    encoder.put_values([(new.key, encode_record(new))], release=[(new.key, "req-1")])
    [header] = ingress.lookup_or_claim([new.key], ttl_s=10)
    assert header.num_tokens == 6
    assert encoder.claim(new.key, ttl_s=10)  # released: claimable again (the value is there)
    # a refused value still releases its claim: waiters are not left to the ttl
    bad = new_key()
    assert ingress.lookup_or_claim([bad], ttl_s=10, token="req-3") == [Claim.WON]
    encoder.put_values([(bad, b"not a record")], release=[(bad, "req-3")])
    assert ingress.lookup_or_claim([bad], ttl_s=10) == [Claim.WON]


def test_lookup_states_answers_headers_or_whether_a_claim_is_held(make_store) -> None:
    """What single flight polls: held -> its header; claimed -> CLAIMED until the claim is
    released or expires -> FREE; claims nothing itself and counts no miss."""
    from vitserve.cache.base import Pending

    a = make_store()
    b = make_store.peer(a)
    held, claimed, free, expiring = make_record(rows=4, seed=41), new_key(), new_key(), new_key()
    a.put_many([held])
    assert b.claim(claimed, ttl_s=10, token="t") and b.claim(expiring, ttl_s=0.3, token="t")
    misses = a.stats()["misses"]
    answers = a.lookup_states([held.key, claimed, free, expiring])
    assert answers[0].key == held.key and answers[0].num_tokens == 4
    assert answers[1:] == [Pending.CLAIMED, Pending.FREE, Pending.CLAIMED]
    assert a.stats()["misses"] == misses  # a poll is not a lookup
    assert a.claim(free, ttl_s=10)  # lookup_states claimed nothing
    b.release(claimed, token="t")
    time.sleep(0.6)
    assert a.lookup_states([claimed, expiring]) == [Pending.FREE, Pending.FREE]
    assert a.lookup_states([]) == []


def test_namespaces_are_isolated(make_store) -> None:
    tenant_a = make_store(namespace="tenant-a-" + new_key()[:8])
    tenant_b = make_store(namespace="tenant-b-" + new_key()[:8])
    record = make_record(seed=9)
    tenant_a.put_many([record])
    assert tenant_b.exists_many([record.key]) == [False]
    assert tenant_b.get(record.key) is None
    assert tenant_b.get_rows(record.key, 0, 1) is None
    assert not tenant_b.delete(record.key)
    assert tenant_b.claim(record.key, ttl_s=5)  # claims are per namespace too
    assert tenant_a.claim(record.key, ttl_s=5)
    _assert_same(tenant_a.get(record.key), record)


def _corruptions(record, other) -> dict[str, bytes]:
    good = bytes(encode_record(record))
    flipped = bytearray(good)
    flipped[-3] ^= 0x40
    newer = bytearray(good)
    magic, version, flags, header_len, offset = PREFIX.unpack_from(newer, 0)
    PREFIX.pack_into(newer, 0, magic, version + 1, flags, header_len, offset)
    return {
        "flipped payload byte": bytes(flipped),
        "truncated": good[: len(good) - 100],
        "wrong key": bytes(encode_record(other)),
        "garbage header": good[:16] + b"\xc1" * 64 + good[80:],
        "newer format version": bytes(newer),
        "not a record": b"hello",
        "short prefix": struct.pack("<4s", b"VSEM"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "flipped payload byte",
        "truncated",
        "wrong key",
        "garbage header",
        "newer format version",
        "not a record",
        "short prefix",
    ],
)
def test_corrupt_values_are_misses_never_data(make_store, case: str) -> None:
    store = make_store()
    record = make_record(rows=300, width=64, seed=11)
    value = _corruptions(record, make_record(seed=12))[case]
    before = store.stats()
    store.put_values([(record.key, value)])
    assert store.get(record.key) is None
    # the last rows: every corruption here reaches their checksum block (a row range checks only
    # its own blocks, see test_payload_checksum_is_verified_on_every_read)
    assert store.get_rows(record.key, 290, 300) is None
    after = store.stats()
    counted = (after["integrity_misses"] - before["integrity_misses"]) + (
        after["rejected"] - before["rejected"]
    )
    assert counted >= 1
    # a good value under the same key is served again
    store.put_many([record])
    _assert_same(store.get(record.key), record)


def test_headers_and_raw_values(make_store) -> None:
    store = make_store()
    records = [
        make_record(rows=40, width=16, dtype="bf16", seed=21),
        make_record(rows=7, width=8, seed=22),
    ]
    store.put_many(records)
    missing = new_key()
    headers = store.headers_many([records[0].key, missing, records[1].key])
    assert headers[1] is None
    assert (headers[0].dtype, headers[0].num_tokens, headers[0].grid) == ("bf16", 40, (1, 80, 2))
    assert (headers[2].num_tokens, headers[2].tensors[0].width) == (7, 8)
    assert bytes(store.get_value(records[1].key)) == bytes(encode_record(records[1]))
    assert store.get_value(missing) is None
