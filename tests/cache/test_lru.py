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
