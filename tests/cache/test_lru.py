"""The pure byte-budgeted LRU behind the in-process and node-local stores."""

from __future__ import annotations

import pytest

from vitserve.cache.lru import ByteBudgetLru
from vitserve.errors import ConfigError


def test_budget_lru_order_and_counters() -> None:
    lru = ByteBudgetLru(100)
    for i in range(4):
        assert lru.put(f"k{i}", i, 30, None)  # 4 x 30 > 100: k0 goes
    assert (len(lru), lru.bytes, lru.evictions) == (3, 90, 1)
    assert lru.get("k1", 0.0) == 1  # k1 now most recently used
    lru.put("k4", 4, 30, None)  # evicts k2, the least recently used
    assert [lru.contains(f"k{i}", 0.0) for i in range(5)] == [False, True, False, True, True]
    assert not lru.put("big", 0, 101, None) and lru.too_large == 1
    lru.put("k1", "new", 10, None)  # replacing frees the old size
    assert lru.bytes == 70 and lru.get("k1", 0.0) == "new"
    lru.resize(40)
    assert lru.bytes <= 40 and lru.max_bytes == 40


def test_ttl_is_checked_against_the_given_clock() -> None:
    lru = ByteBudgetLru(100)
    lru.put("a", "x", 10, expires=5.0)
    assert lru.get("a", 4.9) == "x"
    assert lru.get("a", 5.0) is None and lru.expired == 1 and lru.bytes == 0
    with pytest.raises(ConfigError):
        ByteBudgetLru(0)


# -- shares: a namespace's bytes up to share_bytes are its own ------------------------------------
def test_another_namespaces_writes_never_take_a_namespace_below_its_share() -> None:
    lru = ByteBudgetLru(100, share_bytes=40)
    for i in range(4):
        assert lru.put(f"a/{i}", i, 10, None)  # a: 40 bytes, its whole share
    for i in range(50):  # b writes five times the budget
        assert lru.put(f"b/{i}", i, 10, None)
    assert all(lru.contains(f"a/{i}", 0.0) for i in range(4))
    assert lru.namespace_bytes("a") == 40 and lru.namespace_bytes("b") == 60
    assert lru.evictions == 44 and lru.over_share == 0  # b evicted its own, least recent first
    assert [lru.contains(f"b/{i}", 0.0) for i in (43, 44, 49)] == [False, True, True]


def test_a_namespace_may_borrow_spare_room_which_others_then_take_back() -> None:
    lru = ByteBudgetLru(100, share_bytes=40)
    for i in range(9):
        lru.put(f"a/{i}", i, 10, None)  # 90 bytes: the room is spare
    assert lru.namespace_bytes("a") == 90
    for i in range(6):
        assert lru.put(f"b/{i}", i, 10, None)
    assert lru.namespace_bytes("a") == 40 and lru.namespace_bytes("b") == 60
    assert [lru.contains(f"a/{i}", 0.0) for i in range(9)] == [False] * 5 + [True] * 4
    lru.get("a/5", 0.0)  # used: a's least recently used is now a/6


def test_a_put_that_would_take_someone_below_its_share_is_refused_and_counted() -> None:
    """A budget smaller than the shares: once everyone is within its share, nothing is evicted
    for a newcomer; its put is refused (counted), and what is held stays."""
    lru = ByteBudgetLru(60, share_bytes=40)
    for i in range(3):
        lru.put(f"a/{i}", i, 10, None)
        lru.put(f"b/{i}", i, 10, None)
    assert not lru.put("c/0", 0, 10, None)
    assert lru.over_share == 1 and lru.bytes == 60 and lru.evictions == 0
    assert lru.stats()["over_share"] == 1
    assert lru.put("a/3", 3, 10, None)  # a's own entries make room for a
    assert not lru.contains("a/0", 0.0) and lru.namespace_bytes("b") == 30


def test_without_shares_one_lru_for_all() -> None:
    lru = ByteBudgetLru(40)
    for i in range(4):
        lru.put(f"a/{i}", i, 10, None)
    lru.put("b/0", 0, 10, None)
    assert not lru.contains("a/0", 0.0) and lru.namespace_bytes("a") == 30


@pytest.mark.slow
def test_shares_hold_under_any_sequence_of_writes_reads_and_deletes() -> None:
    """Property: whatever the sequence, after each put of namespace W every other namespace
    that held at least ``share`` still does, and none lost an entry unless it was above it; the
    byte counts match the entries."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "pop"]),
            st.sampled_from("abc"),
            st.integers(0, 7),
            st.integers(1, 30),
        ),
        max_size=80,
    )

    @settings(max_examples=300, deadline=None)
    @given(ops)
    def check(sequence: list[tuple[str, str, int, int]]) -> None:
        share = 40
        lru = ByteBudgetLru(100, share_bytes=share)
        for op, ns, i, size in sequence:
            key = f"{ns}/{i}"
            if op == "get":
                lru.get(key, 0.0)
                continue
            if op == "pop":
                lru.pop(key)
                continue
            before = {n: lru.namespace_bytes(n) for n in "abc"}
            held = {n: {k for k in lru._entries if k.startswith(f"{n}/")} for n in "abc"}
            lru.put(key, 0, size, None)
            assert lru.bytes <= lru.max_bytes
            assert lru.bytes == sum(e.nbytes for e in lru._entries.values())
            for other in set("abc") - {ns}:
                now = lru.namespace_bytes(other)
                if now < before[other]:  # it lost entries: only from above its share
                    assert now >= share, (other, before[other], now)
                else:
                    assert {k for k in lru._entries if k.startswith(f"{other}/")} == held[other]

    check()
