"""The vLLM connector's decisions (``vitserve.client.ec_plan``), without vLLM or a store.

The connector itself runs inside a real vLLM in ``tests/vllm`` (``make test-vllm``)."""

from __future__ import annotations

import pickle

import pytest

from vitserve.client.ec_plan import (
    Breaker,
    BudgetedCalls,
    ECCounts,
    ItemLoad,
    LoadPlan,
    OverBudget,
    ProbeBook,
    PublishWaits,
    is_vitserve_key,
    item_identifier,
    next_chunk,
    parse_identifier,
    pixel_option_problem,
)
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


def test_a_held_key_of_another_grid_is_a_miss() -> None:
    """Rows and width fit, the patch grid vLLM made from its own pixels does not (another
    crop or size of the image with as many rows): a counted mismatch, never a hit."""
    book, counts = ProbeBook(), ECCounts()
    a, b, c = key(1), key(2), key(3)
    book.to_probe("r", [a, b, c])
    grids = {a: (1, 8, 8), b: (1, 4, 16), c: None}  # c: a model without a grid to compare
    book.record(
        [a, b, c], [handle(a), handle(b), handle(c)], {a: 16, b: 16, c: 16}, WIDTH, counts, grids
    )
    assert book.hit(a) is not None and book.hit(b) is None and book.hit(c) is not None
    assert (counts.hits, counts.misses, counts.mismatches) == (2, 1, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_failures_in_a_row_then_lets_one_trial_through() -> None:
    clock = Clock()
    breaker = Breaker(failures=3, open_s=5.0, clock=clock)
    assert breaker.allow() and not breaker.failed() and not breaker.failed()
    breaker.succeeded()  # a success breaks the run
    assert not breaker.failed() and not breaker.failed()
    assert breaker.failed() and breaker.state == "open" and breaker.opened == 1
    assert not breaker.allow()
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.state == "half-open"
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    assert breaker.failed() and breaker.opened == 2  # the trial failed: open again, at once
    assert not breaker.allow()
    clock.now += 5.1
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_a_budgeted_call_past_its_budget_frees_the_caller_and_a_hung_store_piles_nothing() -> None:
    import threading
    import time

    calls = BudgetedCalls(budget_s=0.05, max_late=2)
    assert calls.run(lambda x: x + 1, 1) == 2
    release = threading.Event()
    started = time.monotonic()
    for _ in range(2):  # a hung store: each caller freed at its budget
        with pytest.raises(OverBudget) as info:
            calls.run(release.wait, 30)
        assert info.value.started
    assert time.monotonic() - started < 5  # two budgets, not the calls' 30 s
    assert calls.running == 2
    with pytest.raises(OverBudget) as info:  # max_late under way: refused without a thread
        calls.run(lambda: 1)
    assert not info.value.started
    release.set()
    deadline = time.monotonic() + 5
    while calls.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.running == 0 and calls.run(lambda: "again") == "again"
    with pytest.raises(ZeroDivisionError):  # a call's own error reaches the caller
        calls.run(lambda: 1 / 0)
    calls.close()


def test_a_probe_past_its_budget_or_behind_an_open_breaker_is_a_counted_miss() -> None:
    book, counts = ProbeBook(), ECCounts()
    a, b = key(1), key(2)
    book.failed(book.to_probe("r", [a]), counts, "timeout")
    book.failed(book.to_probe("s", [b]), counts, "breaker")
    assert book.hit(a) is None and book.hit(b) is None
    assert (counts.probe_timeouts, counts.breaker_skips, counts.probe_errors) == (1, 1, 0)
    assert counts.misses == 2


def test_identifiers_name_an_entry_in_its_namespace() -> None:
    k = key(7)
    assert item_identifier("", k) == k and parse_identifier(k) == ("", k)
    qualified = item_identifier("t-main.alice", k)
    assert qualified == f"t-main.alice/{k}" and parse_identifier(qualified) == ("t-main.alice", k)
    for other in (f"a/b/{k}", f"x:y/{k}", f"/{k}", f"ns/{k.upper()}", "ns/abc", f"{k}/ns"):
        assert parse_identifier(other) is None and not is_vitserve_key(other)
    load = ItemLoad("r", 0, handle(k), "t-main.alice")
    assert load.identifier == qualified and load.key == k
    plan = LoadPlan([load, ItemLoad("s", 1, handle(k))])  # one key, two namespaces: two entries
    assert [x.identifier for x in plan.distinct(set())] == [qualified, k]
    assert plan.distinct({qualified}) == [plan.loads[1]]


def test_only_media_options_that_change_no_pixel_pass() -> None:
    assert pixel_option_problem(None) is None
    assert pixel_option_problem({"video": {"num_frames": 8}}) is None
    neutral = {"image": {"rgba_background_color": [255, 255, 255], "image_mode": "RGB"}}
    assert pixel_option_problem(neutral) is None
    for changed in (
        {"rgba_background_color": [0, 0, 0]},
        {"image_mode": "RGBA"},
        {"image_mode": None},
        {"some_future_option": 1},
    ):
        problem = pixel_option_problem({"image": changed})
        assert problem is not None and next(iter(changed)) in problem


# -- a chunk waits for its own images only -----------------------------------------------------
def test_the_next_chunk_reaches_only_the_items_it_overlaps() -> None:
    spans = [("a", 10, 100), ("b", 200, 100), ("c", 600, 50)]
    assert next_chunk(spans, 0, 150) == ["a"]  # b starts past the chunk's end
    assert next_chunk(spans, 0, 201) == ["a", "b"]
    assert next_chunk(spans, 110, 490) == ["b"]  # a computed; c starts at the chunk's end
    assert next_chunk(spans, 110, 491) == ["b", "c"]
    assert next_chunk(spans, 250, 10) == ["b"]  # inside b: b's rows are still needed
    assert next_chunk(spans, 300, 100) == []  # between b and c: text only
    assert next_chunk(spans, 0, None) == ["a", "b", "c"]  # chunked prefill off: all of it
    assert next_chunk(spans, 650, None) == []


def test_a_claimed_image_is_waited_for_and_asked_again_only_every_poll() -> None:
    waits = PublishWaits(wait_s=10.0, poll_s=0.005)
    a, b = key(1), key(2)
    assert waits.due([a, b], now=0.0) == [a, b]  # never asked
    assert waits.claimed(a, now=0.0) and waits.waiting(a) and not waits.waiting(b)
    assert waits.due([a, b], now=0.001) == [b]  # a was asked a moment ago
    assert waits.due([a, b], now=0.005) == [a, b]
    assert waits.claimed(a, now=5.0)  # still claimed, within the wait
    waits.settled(a)  # its record came
    assert not waits.waiting(a) and waits.due([a], now=5.0001) == [a]


def test_an_idle_step_lasts_until_the_first_waited_key_is_due_and_never_past_a_poll() -> None:
    """What an engine step that schedules nothing idles: until the earliest waited-for key is
    asked about again, 0 when one is due, never longer than a poll (a new request waits at
    most that)."""
    waits = PublishWaits(wait_s=10.0, poll_s=0.005)
    assert waits.next_due_in(now=0.0) == 0.005  # nothing waited for (a late probe): one poll
    a, b = key(1), key(2)
    assert waits.claimed(a, now=1.000)
    assert waits.next_due_in(now=1.001) == pytest.approx(0.004)
    assert waits.claimed(b, now=1.003)
    assert waits.next_due_in(now=1.004) == pytest.approx(0.001)  # a's is first due
    assert waits.next_due_in(now=1.010) == 0.0  # overdue: step again at once
    assert waits.next_due_in(now=0.5) == 0.005  # a clock behind the asks: at most a poll
    waits.settled(a)
    waits.settled(b)
    assert waits.next_due_in(now=2.0) == 0.005


def test_a_wait_past_its_limit_gives_up_and_a_later_claim_starts_over() -> None:
    waits = PublishWaits(wait_s=2.0)
    a = key(3)
    assert waits.claimed(a, now=100.0)
    assert waits.claimed(a, now=102.0)  # exactly at the limit: still waited for
    assert not waits.claimed(a, now=102.01)  # past it: a miss
    assert not waits.waiting(a)
    assert waits.claimed(a, now=200.0)  # asked again later (another request): a new wait


def test_a_claim_that_ends_is_given_a_grace_to_be_taken_over() -> None:
    """Found free while waited for: still waited for within ``grace_s`` (an encoder taking the
    image over claims it again), a miss after; a claim seen again ends the grace."""
    waits = PublishWaits(wait_s=30.0, grace_s=0.25)
    a, b = key(6), key(7)
    assert not waits.freed(a, 0.0)  # never waited for: free is a miss at once
    assert waits.claimed(a, 0.0)
    assert waits.freed(a, 1.0) and waits.freed(a, 1.25)  # within the grace
    assert waits.claimed(a, 1.3)  # taken over: waiting again, the grace reset
    assert waits.freed(a, 2.0) and waits.freed(a, 2.2)
    assert not waits.freed(a, 2.26) and not waits.waiting(a)  # ended without a record
    assert waits.claimed(b, 0.0) and not waits.freed(b, 31.0)  # past wait_s: no grace


def test_waits_of_finished_requests_are_forgotten() -> None:
    waits = PublishWaits(wait_s=1.0)
    a, b = key(4), key(5)
    waits.claimed(a, 0.0)
    waits.claimed(b, 0.0)
    waits.forget([a])
    assert not waits.waiting(a) and waits.waiting(b)
    assert waits.since.keys() == waits.asked.keys() == {b}


@pytest.mark.parametrize(
    ("wait_s", "poll_s", "grace_s"), [(-1.0, 0.005, 0.1), (1.0, 0.0, 0.1), (1.0, 0.005, -1.0)]
)
def test_publish_waits_refuse_nonsense(wait_s: float, poll_s: float, grace_s: float) -> None:
    with pytest.raises(ValueError):
        PublishWaits(wait_s=wait_s, poll_s=poll_s, grace_s=grace_s)


def test_a_call_past_its_budget_hands_over_its_future() -> None:
    """The caller goes on at the budget; the call's answer arrives later on the future it was
    handed (the connector takes a late probe's answer instead of calling the keys misses)."""
    import threading

    gate = threading.Event()
    calls = BudgetedCalls(0.05)
    try:
        with pytest.raises(OverBudget) as raised:
            calls.run(lambda: gate.wait(5) and "late answer")
        assert raised.value.started and raised.value.future is not None
        gate.set()
        assert raised.value.future.result(timeout=5) == "late answer"
    finally:
        calls.close()
