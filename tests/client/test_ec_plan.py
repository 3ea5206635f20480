"""The vLLM connector's decisions (``vitserve.client.ec_plan``), without vLLM or a store.

The connector itself runs inside a real vLLM in ``tests/vllm`` (``make test-vllm``)."""

from __future__ import annotations

import pickle

from vitserve.client.ec_plan import ECCounts, ItemLoad, LoadPlan, ProbeBook, is_vitserve_key
from vitserve.client.handles import ImageHandle
from vitserve.keys import content_key

WIDTH = 64


def key(n: int) -> str:
    return content_key(bytes([n]), "fp", "")


def handle(k: str, rows: int = 16, width: int = WIDTH) -> ImageHandle:
    return ImageHandle(
        key=k, num_tokens=rows, grid=(1, 8, 8), dtype="fp32", shape=(rows, width), cached=True
    )


def test_only_vitserve_keys_are_keys() -> None:
    assert is_vitserve_key(key(1))
    assert not is_vitserve_key(key(1).upper())
    assert not is_vitserve_key(key(1)[:-1])
    assert not is_vitserve_key("0" * 63 + "g")
    # vLLM's own identifiers (a hash of the pixels, or a uuid a client chose) are not
    assert not is_vitserve_key("a1b2c3")
    assert not is_vitserve_key("lora:" + key(1))


def test_one_probe_per_request_and_answers_kept_while_used() -> None:
    book, counts = ProbeBook(), ECCounts()
    a, b = key(1), key(2)
    assert book.to_probe("r1", [a, b, a, "vllm-hash"]) == [a, b]  # distinct keys, no others
    book.record([a, b], [handle(a), None], {a: 16, b: 16}, WIDTH, counts)
    assert book.hit(a) == handle(a) and book.hit(b) is None
    assert book.to_probe("r1", [a, b]) == []  # the same request asks nothing again
    assert book.to_probe("r2", [a]) == []  # nor does another using a key answered already
    book.finish("r1")
    assert book.known(a) and not book.known(b)  # r2 still uses a; b had no other user
    book.finish("r2")
    assert not book.known(a)
    assert book.to_probe("r3", [a]) == [a]  # asked afresh once nobody uses the answer
    assert (counts.probed, counts.hits, counts.misses) == (2, 1, 1)


def test_a_held_key_whose_shape_does_not_fit_is_a_miss() -> None:
    book, counts = ProbeBook(), ECCounts()
    a, b, c = key(1), key(2), key(3)
    book.to_probe("r", [a, b, c])
    found = [handle(a, rows=15), handle(b, width=WIDTH * 2), handle(c)]
    book.record([a, b, c], found, {a: 16, b: 16, c: 16}, WIDTH, counts)
    assert [book.hit(k) is not None for k in (a, b, c)] == [False, False, True]
    assert (counts.hits, counts.misses, counts.mismatches) == (1, 2, 2)


def test_a_failed_probe_is_a_miss_while_the_request_lives() -> None:
    book, counts = ProbeBook(), ECCounts()
    a = key(1)
    book.failed(book.to_probe("r", [a]), counts)
    assert book.known(a) and book.hit(a) is None
    assert (counts.probe_errors, counts.misses) == (1, 1)
    book.finish("r")
    assert book.to_probe("r2", [a]) == [a]


def test_failed_loads_go_back_to_vllms_encoder_once_per_key() -> None:
    a, b, c = key(1), key(2), key(3)
    plan = LoadPlan(
        [
            ItemLoad("r1", 0, handle(a)),
            ItemLoad("r1", 1, handle(b)),
            ItemLoad("r2", 2, handle(a)),
            ItemLoad("r2", 0, handle(c)),
        ]
    )
    # c is in vLLM's encoder cache already: not read; a is read once for both requests
    assert [h.key for h in plan.distinct({c: object()})] == [a, b]
    plan.loaded.add(b)
    plan.failed.add(a)
    assert plan.fallbacks() == {"r1": [0]}  # its output then serves r2's item 2 too
    plan.failed.add(c)
    assert plan.fallbacks() == {"r1": [0], "r2": [0]}


def test_counts_add_take_and_cross_processes_as_plain_data() -> None:
    counts = ECCounts(hits=2, load_bytes=100, load_seconds=0.5)
    counts.add({"hits": 1, "loads": 3}).add(ECCounts(load_fallbacks=1))
    assert counts.as_dict()["hits"] == 3 and counts.loads == 3 and counts.load_fallbacks == 1
    taken = counts.take()
    assert counts.is_empty() and not taken.is_empty() and taken.load_seconds == 0.5
    assert ECCounts().add(pickle.loads(pickle.dumps(taken.as_dict()))) == taken
    load = ItemLoad("r", 1, handle(key(1)))
    assert pickle.loads(pickle.dumps(load)) == load  # it rides in vLLM's scheduler output
