"""The counts the code owns (``metrics.Tally`` / ``metrics.Counts``): every increment counted
once, across threads, under its name and tags, and a snapshot never moves afterwards."""

from __future__ import annotations

import sys
import threading

import pytest

from vitserve.deployments.common import metrics


@pytest.fixture
def switch_often() -> object:
    """Threads switched every microsecond (5 ms by default), so that an unguarded
    read-add-write loses increments at once: without Tally's lock the test below lost ~13,000
    of 40,000 here, and none at the default interval."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(default)


def test_concurrent_adds_are_each_counted_once(switch_often) -> None:
    tally = metrics.Tally()
    start = threading.Barrier(8)

    def add(i: int) -> None:
        start.wait()
        for _ in range(5000):
            tally.add("requests_total", 1.0, {"route": "encode", "status": str(200 + i % 2)})

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = tally.counts()
    assert counts.value("requests_total") == 8 * 5000
    assert counts.value("requests_total", status="200") == 4 * 5000
    assert counts.value("requests_total", route="encode", status="201") == 4 * 5000


def test_tags_in_another_order_are_one_sample_and_labels_select() -> None:
    tally = metrics.Tally()
    tally.add("prefill_images_total", 2.0, {"kind": "sent"})
    tally.add("store_errors_total", 1.0, {"op": "put"})
    tally.add("requests_total", 1.0, {"route": "chat", "status": "200"})
    tally.add("requests_total", 1.0, {"status": "200", "route": "chat"})
    counts = tally.counts()
    assert len(counts.samples) == 3
    assert counts.value("requests_total", route="chat") == 2
    assert counts.value("requests_total", route="encode") == 0
    assert counts.value("prefill_images_total", kind="uploaded") == 0
    assert counts.value("missing_total") == 0
    assert {"name": "store_errors_total", "tags": {"op": "put"}, "value": 1.0} in counts.as_json()


def test_a_snapshot_is_a_copy() -> None:
    tally = metrics.Tally()
    tally.add("cache_hits_total", 1.0, {})
    first = tally.counts()
    tally.add("cache_hits_total", 1.0, {})
    assert (first.value("cache_hits_total"), tally.counts().value("cache_hits_total")) == (1, 2)
    with pytest.raises(AttributeError):
        first.samples = ()  # type: ignore[misc]


def test_inc_counts_what_it_exports_and_refuses_an_unknown_name() -> None:
    before = metrics.counts().value("bytes_fetched_total")
    metrics.inc("bytes_fetched_total", 100)
    metrics.inc("bytes_fetched_total", 0)  # nothing to record
    assert metrics.counts().value("bytes_fetched_total") - before == 100
    with pytest.raises(KeyError):
        metrics.inc("no_such_total")
    assert all(name in metrics._SPECS for name, _, _ in metrics.counts().samples)
