"""The encoder router's policy (vitserve.deployments.encoder.routing), as plain bookkeeping."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitserve.deployments.encoder.request_router import hint_of
from vitserve.deployments.encoder.routing import (
    ADMITTED_PATCHES,
    BY_CALLER,
    ROOM_PATCHES,
    RouteHint,
    WorkRouting,
    rendezvous_rank,
)
from vitserve.deployments.encoder.single_flight import ClaimState
from vitserve.deployments.encoder.wire import EncodeBatch

REPLICAS = ["r-a", "r-b", "r-c"]
THUMB, LARGE = 256, 16_384
ROOMY = 10**9  # a room no test fills


def owner_of(key: str, replicas: list[str]) -> str:
    return max(replicas, key=lambda r: rendezvous_rank(key, r))


def hint(*keys: str, patches: int = THUMB) -> RouteHint:
    return RouteHint(keys, (patches,) * len(keys))


def test_idle_replicas_send_a_key_to_its_owner_every_time() -> None:
    routing = WorkRouting()
    for i in range(50):
        key = f"k{i}"
        assert routing.choose(hint(key), REPLICAS)[0] == owner_of(key, REPLICAS)
        assert routing.choose(hint(key), REPLICAS)[0] == owner_of(key, REPLICAS)


def test_keys_spread_over_the_replicas() -> None:
    routing = WorkRouting()
    firsts = [routing.choose(hint(f"key-{i}"), REPLICAS)[0] for i in range(300)]
    assert {r: firsts.count(r) for r in REPLICAS} == pytest.approx(
        {r: 100 for r in REPLICAS}, abs=30
    )


def test_a_key_keeps_its_owner_when_another_replica_leaves() -> None:
    routing = WorkRouting()
    moved = 0
    for i in range(200):
        key = f"key-{i}"
        before = routing.choose(hint(key), REPLICAS)[0]
        gone = next(r for r in REPLICAS if r != before)
        after = routing.choose(hint(key), [r for r in REPLICAS if r != gone])[0]
        moved += after != before
    assert moved == 0


def test_a_thumbnail_does_not_queue_behind_a_large_image_on_its_owner() -> None:
    routing = WorkRouting()
    key = "thumb"
    owner = owner_of(key, REPLICAS[:2])
    other = next(r for r in REPLICAS[:2] if r != owner)
    routing.routed("big", owner, LARGE, now=0.0)
    # the owner is past the bound: not even a fallback (Serve would fall to it when the idle
    # replica's queue probe is late, and the thumbnail would wait for the large image)
    assert routing.choose(hint(key), REPLICAS[:2]) == [other]
    routing.completed("big", owner)  # the large image is done: the key goes home again
    assert routing.choose(hint(key), REPLICAS[:2])[0] == owner


def test_the_owner_keeps_its_key_within_the_bound() -> None:
    routing = WorkRouting(balance=1.25)
    routing.reported({r: {ROOM_PATCHES: ROOMY} for r in REPLICAS})
    key = "k"
    owner = owner_of(key, REPLICAS[:2])
    other = next(r for r in REPLICAS[:2] if r != owner)
    routing.routed("c1", owner, 1000, now=0.0)
    routing.routed("c2", other, 900, now=0.0)
    # 1000 <= 1.25 * (1900 + 256) / 2 = 1347.5: within the bound
    assert routing.choose(hint(key), REPLICAS[:2])[0] == owner
    routing.routed("c3", owner, 400, now=0.0)
    # 1400 <= 1.25 * (2300 + 256) / 2 = 1597.5: still the owner's
    assert routing.choose(hint(key), REPLICAS[:2])[0] == owner
    routing.routed("c4", owner, 1000, now=0.0)
    # 2400 > 1.25 * (3300 + 256) / 2 = 2222.5: past the bound, the least loaded only
    assert routing.choose(hint(key), REPLICAS[:2]) == [other]


def test_a_control_call_goes_anywhere_never_waits_and_spreads_whatever_the_load() -> None:
    routing = WorkRouting()
    routing.reported({r: {ROOM_PATCHES: 100} for r in REPLICAS})
    routing.routed("c1", "r-a", 500, now=0.0)  # every replica past its room: encodes wait
    routing.routed("c2", "r-b", 100, now=0.0)
    routing.routed("c3", "r-c", 100, now=0.0)
    assert routing.choose(hint("k"), REPLICAS) == []
    orders = [routing.choose(RouteHint(), REPLICAS, tie=f"call-{i}") for i in range(30)]
    assert all(sorted(o) == REPLICAS for o in orders)
    assert {o[0] for o in orders} == set(REPLICAS)  # the most loaded one too


def test_calls_without_keys_spread_over_idle_replicas_by_their_tie() -> None:
    routing = WorkRouting()
    firsts = {routing.choose(RouteHint(), REPLICAS, tie=f"call-{i}")[0] for i in range(30)}
    assert firsts == set(REPLICAS)
    assert routing.choose(RouteHint(), REPLICAS, tie="x") == routing.choose(
        RouteHint(), REPLICAS, tie="x"
    )


def test_the_call_goes_to_the_owner_of_most_of_its_work() -> None:
    routing = WorkRouting()
    keys = [f"key-{i}" for i in range(40)]
    small = next(k for k in keys if owner_of(k, REPLICAS) == "r-a")
    large = next(k for k in keys if owner_of(k, REPLICAS) == "r-b")
    call = RouteHint((small, large), (THUMB, LARGE))
    assert routing.choose(call, REPLICAS)[0] == "r-b"
    call = RouteHint((small, large), (LARGE, THUMB))
    assert routing.choose(call, REPLICAS)[0] == "r-a"


def test_accounting_counts_a_call_until_it_completes_once() -> None:
    routing = WorkRouting()
    routing.routed("c1", "r-a", 300, now=0.0)
    routing.routed("c2", "r-a", 200, now=0.0)
    assert routing.load("r-a") == 500
    routing.completed("c1", "r-a")
    routing.completed("c1", "r-a")  # twice: counted once
    routing.completed("unknown", "r-a")
    assert routing.load("r-a") == 200
    routing.routed("c2", "r-a", 200, now=1.0)  # routed again: replaces, not adds
    assert routing.load("r-a") == 200
    routing.completed("c2", "r-a")
    assert routing.load("r-a") == 0


def test_calls_without_work_interleaved_with_encodes_complete_in_any_order() -> None:
    # Serve's router logged KeyError from completed() when a control call (no work) completed
    # on a replica whose count an encode's completion had just emptied
    routing = WorkRouting()
    routing.routed("encode", "r-a", 300, now=0.0)
    routing.routed("counters-1", "r-a", 0, now=0.0)
    routing.routed("counters-2", "r-a", 0, now=0.0)
    routing.completed("encode", "r-a")
    routing.completed("counters-1", "r-a")
    routing.completed("counters-2", "r-a")
    assert routing.load("r-a") == 0
    for i in range(50):  # random interleavings, all settle to nothing
        routing.routed(f"e{i}", REPLICAS[i % 3], i % 4 * 100, now=0.0)
    for i in reversed(range(50)):
        routing.completed(f"e{i}", REPLICAS[i % 3])
    assert [routing.load(r) for r in REPLICAS] == [0, 0, 0]


def test_a_retried_call_counts_where_it_went_last_until_each_attempt_completes() -> None:
    routing = WorkRouting()
    routing.routed("c1", "r-a", 300, now=0.0)
    routing.routed("c1", "r-b", 300, now=0.1)  # the first attempt was refused, retried
    assert (routing.load("r-a"), routing.load("r-b")) == (300, 300)
    routing.completed("c1", "r-a")  # the refused attempt's completion
    assert (routing.load("r-a"), routing.load("r-b")) == (0, 300)


def test_reported_load_adds_other_routers_calls_to_this_ones() -> None:
    routing = WorkRouting(me="ingress-1")
    routing.routed("c1", "r-a", 100, now=0.0)
    routing.reported(
        {
            # r-a holds 100 of ours (known at once: not counted twice) and 50 of another's
            "r-a": {
                ADMITTED_PATCHES: 150,
                BY_CALLER: {"ingress-1": 100, "ingress-2": 50},
                ROOM_PATCHES: ROOMY,
            },
            "r-b": {ADMITTED_PATCHES: 900, BY_CALLER: {"ingress-2": 900}, ROOM_PATCHES: ROOMY},
            "r-c": {},
        }
    )
    assert [routing.load(r) for r in REPLICAS] == [150, 900, 0]
    assert routing.choose(RouteHint(("k",), (THUMB,)), ["r-a", "r-b"]) == ["r-a"]
    routing.completed("c1", "r-a")  # ours completed: gone at once, before the next report
    assert routing.load("r-a") == 50
    routing.reported({})  # a new report replaces the last
    assert routing.load("r-b") == 0


def test_a_replica_past_its_room_takes_no_call_and_none_with_room_means_wait() -> None:
    routing = WorkRouting()
    routing.reported({r: {ROOM_PATCHES: 1000} for r in REPLICAS[:2]})
    routing.routed("big", "r-a", 5000, now=0.0)  # a call larger than the room still went
    assert routing.choose(hint("k"), REPLICAS[:2]) == ["r-b"]
    routing.routed("c2", "r-b", 999, now=0.0)
    assert routing.choose(hint("k"), REPLICAS[:2]) == ["r-b"]  # 999 < 1000: room left
    routing.routed("c3", "r-b", 1, now=0.0)
    assert routing.choose(hint("k"), REPLICAS[:2]) == []  # the call waits in the router
    assert routing.choose(hint("k"), REPLICAS[:2], waited_s=0.99) == []  # for up to hold_s
    assert routing.choose(hint("k"), REPLICAS) == ["r-c"]  # a replica with no report has room
    routing.routed("c4", "r-c", 1, now=0.0)  # while it is idle: its room is not known yet
    assert routing.choose(hint("k"), REPLICAS) == []
    routing.reported({r: {ROOM_PATCHES: 1000} for r in REPLICAS})  # until it reports
    assert routing.choose(hint("k"), REPLICAS) == ["r-c"]
    routing.completed("c4", "r-c")
    routing.completed("big", "r-a")
    assert routing.choose(hint("k"), REPLICAS[:2]) == ["r-a"]


def test_the_owner_without_room_gives_way() -> None:
    routing = WorkRouting()
    key = "k"
    owner = owner_of(key, REPLICAS[:2])
    other = next(r for r in REPLICAS[:2] if r != owner)
    routing.reported({owner: {ROOM_PATCHES: 100}, other: {ROOM_PATCHES: ROOMY}})
    routing.routed("c1", owner, 100, now=0.0)
    routing.routed("c2", other, 150, now=0.0)  # within the bound, but the owner is full
    assert routing.choose(hint(key), REPLICAS[:2]) == [other]


def test_a_call_held_for_hold_s_goes_to_the_least_loaded_replica_whose_admission_answers() -> None:
    routing = WorkRouting(hold_s=1.0)
    routing.reported({r: {ROOM_PATCHES: 100} for r in REPLICAS[:2]})
    routing.routed("c1", "r-a", 600, now=0.0)
    routing.routed("c2", "r-b", 100, now=0.0)  # both past their room
    assert routing.choose(hint("k"), REPLICAS[:2], waited_s=0.5) == []
    # held long enough: the least loaded (r-b; r-a is past the bound 1.25 * 956 / 2 = 597.5)
    assert routing.choose(hint("k"), REPLICAS[:2], waited_s=1.0) == ["r-b"]
    assert WorkRouting(hold_s=0).choose(hint("k"), ["r-a"]) == ["r-a"]  # no room known: room


def test_calls_never_completed_are_forgotten() -> None:
    routing = WorkRouting(forget_after_s=10.0)
    routing.routed("old", "r-a", 300, now=0.0)
    routing.routed("new", "r-a", 100, now=5.0)
    assert routing.forget_stale(now=12.0) == 1
    assert routing.load("r-a") == 100


def test_bad_settings_and_hints_are_refused() -> None:
    with pytest.raises(ValueError, match="balance"):
        WorkRouting(balance=0.9)
    with pytest.raises(ValueError, match="forget_after_s"):
        WorkRouting(forget_after_s=0)
    with pytest.raises(ValueError, match="hold_s"):
        WorkRouting(hold_s=-1)
    with pytest.raises(ValueError, match="one patch count per key"):
        RouteHint(("a", "b"), (1,))
    with pytest.raises(ValueError, match="not negative"):
        RouteHint(("a",), (-1,))


def test_an_encode_batch_carries_its_hint_to_the_router() -> None:
    batch = EncodeBatch(
        keys=["a", "b"], indices=[0, 1], claims=[ClaimState.WON] * 2, token="t", patches=[5, 7]
    )
    pending = SimpleNamespace(args=[batch, None], kwargs={})
    assert hint_of(pending) == RouteHint(("a", "b"), (5, 7))  # type: ignore[arg-type]
    batch.patches = []  # an older caller: keys without work
    assert hint_of(pending) == RouteHint(("a", "b"), (0, 0))  # type: ignore[arg-type]
    assert hint_of(SimpleNamespace(args=[], kwargs={})) == RouteHint()  # type: ignore[arg-type]
    assert hint_of(None) == RouteHint()


loads = st.dictionaries(st.sampled_from(REPLICAS), st.integers(0, 100_000), max_size=3)


@settings(max_examples=200, deadline=None)
@given(
    loads=loads,
    reported=loads,
    rooms=st.dictionaries(st.sampled_from(REPLICAS), st.integers(1, 100_000), max_size=3),
    keys=st.lists(st.text(min_size=1, max_size=8), max_size=4),
    patches=st.integers(0, 20_000),
    n=st.integers(1, 3),
    hold=st.booleans(),
)
def test_the_choice_is_a_preference_order_that_keeps_the_rule(
    loads: dict[str, int],
    reported: dict[str, int],
    rooms: dict[str, int],
    keys: list[str],
    patches: int,
    n: int,
    hold: bool,
) -> None:
    routing = WorkRouting()
    for replica, work in loads.items():
        routing.routed(f"call-{replica}", replica, work, now=0.0)
    routing.reported(
        {r: {ADMITTED_PATCHES: reported.get(r, 0), ROOM_PATCHES: rooms.get(r)} for r in REPLICAS}
    )
    candidates = REPLICAS[:n]
    call = RouteHint(tuple(keys), (patches,) * len(keys))
    waited = 2.0 if hold else 0.0
    order = routing.choose(call, candidates, waited_s=waited)
    if not keys:  # a control call: every candidate, never held
        assert sorted(order) == sorted(candidates)
        return
    # a replica with no room reported has room only while idle
    roomy = [r for r in candidates if routing.load(r) < rooms.get(r, 1)]
    if not roomy and hold:  # held past hold_s: room no longer counts
        roomy = list(candidates)
    assert len(set(order)) == len(order) and set(order) <= set(roomy)
    if not roomy:
        assert order == []
        return
    total = sum(routing.load(r) for r in candidates) + call.work
    bound = routing.balance * total / n
    least = min(routing.load(r) for r in roomy)
    # the least loaded with room is always there, and every one within the bound
    assert least in [routing.load(r) for r in order]
    assert {r for r in roomy if routing.load(r) <= bound} <= set(order)
    assert all(routing.load(r) <= bound or routing.load(r) == least for r in order)
    first = order[0]
    owner = routing.owner(call, candidates)
    # the first is the least loaded with room, or the owner within the bound
    assert routing.load(first) == least or (first == owner and routing.load(first) <= bound)
    assert [routing.load(r) for r in order if r != owner] == sorted(
        routing.load(r) for r in order if r != owner
    )


def test_a_replica_goes_to_the_oldest_waiting_call_that_prefers_it() -> None:
    """The Serve adapter's FIFO (Serve's routing tasks race for a freed slot; the oldest call
    that prefers it gets it), on Serve's own queue of waiting calls, without a Serve."""
    from collections import deque

    from vitserve.deployments.encoder.request_router import EncoderRequestRouter

    def waiting(call: str, *keys: str, work: int = THUMB, done: bool = False) -> SimpleNamespace:
        batch = EncodeBatch(
            keys=list(keys),
            indices=list(range(len(keys))),
            claims=[ClaimState.WON] * len(keys),
            token="t",
            patches=[work] * len(keys),
        )
        future = SimpleNamespace(done=lambda: done)
        metadata = SimpleNamespace(internal_request_id=call)
        return SimpleNamespace(
            args=[batch], metadata=metadata, created_at=time.time(), future=future
        )

    router = object.__new__(EncoderRequestRouter)  # no Serve: only the policy and the queue
    router.initialize_state(hold_s=60.0)
    router._candidates = ["r-a", "r-b"]
    router.routing.reported({"r-a": {ROOM_PATCHES: 1000}, "r-b": {ROOM_PATCHES: 1000}})
    router.routing.routed("big", "r-a", 1000, now=0.0)  # r-a has no room left
    router._pending_requests_to_fulfill = deque(
        [
            waiting("answered", "k0", done=True),  # routed already: passed over
            waiting("oldest", "k1"),
            waiting("newer", "k2"),
        ]
    )
    assert router._oldest_pending_for("r-b").metadata.internal_request_id == "oldest"
    assert router._oldest_pending_for("r-a") is None  # no call may go to a replica past its room
    control = waiting("control")  # no keys: anywhere, never held, spread by its id
    router._pending_requests_to_fulfill.appendleft(control)
    first = router.routing.choose(RouteHint(), ["r-a", "r-b"], tie="control")[0]
    assert router._oldest_pending_for(first) is control
    router.routing.completed("big", "r-a")  # r-a idle again: each key's call to its owner first
    router._pending_requests_to_fulfill.popleft()
    keys = [f"key-{i}" for i in range(20)]
    on_a = next(k for k in keys if owner_of(k, ["r-a", "r-b"]) == "r-a")
    on_b = next(k for k in keys if owner_of(k, ["r-a", "r-b"]) == "r-b")
    router._pending_requests_to_fulfill = deque([waiting("to-b", on_b), waiting("to-a", on_a)])
    assert router._oldest_pending_for("r-a").metadata.internal_request_id == "to-a"
    assert router._oldest_pending_for("r-b").metadata.internal_request_id == "to-b"


def test_the_router_serve_ships_knows_its_own_calls_in_the_process_it_runs_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve pickles the router class by value (``RequestRouterConfig`` registers its module
    with cloudpickle) and loads it in each ingress replica: the router must name itself by
    that process's ``THIS_CALLER``, or it counts its own calls twice, once itself and once in
    the replicas' reports, and for a report period after they are done."""
    from ray import cloudpickle
    from ray.serve.config import RequestRouterConfig

    from vitserve.deployments.encoder import routing
    from vitserve.deployments.encoder.request_router import ROUTER_PATH

    shipped = RequestRouterConfig(request_router_class=ROUTER_PATH)
    blob = shipped.get_serialized_request_router_cls()
    assert blob, "Serve no longer ships the class pickled: revisit this test"
    monkeypatch.setattr(routing, "THIS_CALLER", "the-replica-process")  # another process
    router = object.__new__(cloudpickle.loads(blob))
    router.initialize_state()
    assert router.routing.me == "the-replica-process"
    # its own call, reported back by the replica, counts once, and not after it completed
    router.routing.routed("call", "r-a", 500, now=0.0)
    report = {ADMITTED_PATCHES: 500, BY_CALLER: {"the-replica-process": 500}}
    router.routing.reported({"r-a": report})
    assert router.routing.load("r-a") == 500
    router.routing.completed("call", "r-a")
    assert router.routing.load("r-a") == 0


def test_the_routing_options_are_built_safely_from_several_threads_at_once() -> None:
    """Building applications in parallel threads (the suite's family applications) made Ray's
    ``RequestRouterConfig`` fail with "... is not registered for pickle by value": it registers
    and unregisters the router's module in process-wide state. ``routing_options`` serializes
    that step."""
    import threading

    from vitserve.deployments.common.config import EncoderDeploymentConfig
    from vitserve.deployments.encoder.app import routing_options

    encoder = EncoderDeploymentConfig()
    assert encoder.routing == "work"
    start, errors = threading.Barrier(8), []

    def build() -> None:
        start.wait()
        for _ in range(20):
            try:
                routing_options(encoder)
            except Exception as exc:  # what Ray raised, to report below
                errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
