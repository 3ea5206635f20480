"""Tests of the pure batch planner (vitserve.encoder.planner), on tiny fake inputs."""

from __future__ import annotations

import ast
import itertools
import random
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path

import pytest

from vitserve.encoder import planner
from vitserve.encoder.planner import Batch, Plan, PlanItem, plan_batches
from vitserve.errors import ConfigError

BIG = 10**12  # a budget every fake input fits in


def make(*spec: tuple[Hashable, int, int]) -> list[PlanItem]:
    """Items 0..n-1 from ``(bucket, patches, act_bytes)`` tuples."""
    return [PlanItem(i, bucket, patches, act) for i, (bucket, patches, act) in enumerate(spec)]


def index_groups(plan: Plan) -> list[tuple[int, ...]]:
    return [batch.indices for batch in plan.batches]


def check_invariants(
    plan: Plan,
    items: Sequence[PlanItem],
    budget: int,
    max_items: int | None = None,
    max_patches: int | None = None,
) -> None:
    """Assert invariants 1-5 of the module docstring, plus locate/gather consistency."""
    by_index = {item.index: item for item in items}
    ordered = sorted(items, key=lambda item: item.index)

    def alone_exceeds(item: PlanItem) -> bool:
        return item.act_bytes > budget or (max_patches is not None and item.patches > max_patches)

    # 5. empty in, empty out
    if not items:
        assert plan.batches == () and plan.oversize_count == 0 and plan.num_items == 0

    # 1. every index exactly once
    planned = [index for batch in plan.batches for index in batch.indices]
    assert sorted(planned) == sorted(by_index)
    assert len(planned) == len(set(planned)) == plan.num_items == len(items)
    assert plan.indices == tuple(sorted(by_index))
    assert plan.forward_calls == len(plan.batches)

    for number, batch in enumerate(plan.batches):
        members = [by_index[index] for index in batch.indices]
        # 2. one bucket per batch
        assert all(member.bucket == batch.bucket for member in members)
        # sums, ascending indices, locate
        assert batch.patches == sum(member.patches for member in members)
        assert batch.act_bytes == sum(member.act_bytes for member in members)
        assert list(batch.indices) == sorted(batch.indices)
        for position, index in enumerate(batch.indices):
            assert plan.locate(index) == (number, position)
        # 3. limits, with the single-item exception
        assert batch.oversize == (batch.num_items == 1 and batch.act_bytes > budget)
        if batch.num_items == 1 and alone_exceeds(members[0]):
            continue
        assert batch.act_bytes <= budget
        assert max_items is None or batch.num_items <= max_items
        assert max_patches is None or batch.patches <= max_patches
    assert plan.oversize_count == sum(batch.oversize for batch in plan.batches)
    assert plan.oversize_count == sum(item.act_bytes > budget for item in items)

    # 4. bucket order = first appearance in input order, batches of a bucket contiguous
    first_seen = list(dict.fromkeys(item.bucket for item in ordered))
    plan_buckets = list(dict.fromkeys(batch.bucket for batch in plan.batches))
    assert plan_buckets == first_seen
    runs = [batch.bucket for batch in plan.batches]
    assert runs == sorted(runs, key=first_seen.index)

    # 4. within a bucket: batches by first index; next-fit over the items that fit alone
    for bucket in first_seen:
        mine = [batch for batch in plan.batches if batch.bucket == bucket]
        assert [b.indices[0] for b in mine] == sorted(b.indices[0] for b in mine)
        alone = {item.index for item in ordered if item.bucket == bucket and alone_exceeds(item)}
        assert {b.indices[0] for b in mine if b.num_items == 1 and b.indices[0] in alone} == alone
        packed = [b for b in mine if not (b.num_items == 1 and b.indices[0] in alone)]
        # contiguous in input order: the packed batches concatenate to the bucket's other items
        flat = [index for b in packed for index in b.indices]
        assert flat == [i.index for i in ordered if i.bucket == bucket and i.index not in alone]
        # maximal: the first item of each packed batch would not have fit in the one before
        for before, after in itertools.pairwise(packed):
            head = by_index[after.indices[0]]
            assert (
                before.act_bytes + head.act_bytes > budget
                or (max_items is not None and before.num_items + 1 > max_items)
                or (max_patches is not None and before.patches + head.patches > max_patches)
            )

    # gather round trip restores input order
    outputs = [[("out", index) for index in batch.indices] for batch in plan.batches]
    assert plan.gather(outputs) == [("out", item.index) for item in ordered]


def test_interleaved_buckets_one_bucket_per_batch() -> None:
    items = make(("a", 4, 10), ("b", 4, 10), ("a", 4, 10), ("b", 4, 10), ("c", 9, 10), ("a", 4, 10))
    plan = plan_batches(items, BIG)
    assert index_groups(plan) == [(0, 2, 5), (1, 3), (4,)]
    assert [batch.bucket for batch in plan.batches] == ["a", "b", "c"]
    assert plan.batches[0] == Batch("a", (0, 2, 5), patches=12, act_bytes=30, oversize=False)
    check_invariants(plan, items, BIG)


def test_tuple_buckets_compare_by_value() -> None:
    items = make(((224, 224), 1, 1), ((336, 336), 1, 1), ((224, 224), 1, 1))
    plan = plan_batches(items, BIG)
    assert index_groups(plan) == [(0, 2), (1,)]


def test_budget_respected_next_fit() -> None:
    items = make(*[("a", 1, act) for act in (4, 4, 4, 3, 6, 1)])
    plan = plan_batches(items, 10)
    assert index_groups(plan) == [(0, 1), (2, 3), (4, 5)]
    assert [batch.act_bytes for batch in plan.batches] == [8, 7, 7]
    assert plan.oversize_count == 0
    check_invariants(plan, items, 10)


def test_batch_exactly_at_budget_fits() -> None:
    items = make(("a", 1, 5), ("a", 1, 5), ("a", 1, 1))
    plan = plan_batches(items, 10)
    assert index_groups(plan) == [(0, 1), (2,)]
    assert plan.batches[0].act_bytes == 10


def test_oversize_item_runs_alone_and_neighbours_unaffected() -> None:
    items = make(("a", 1, 3), ("a", 1, 50), ("a", 1, 3), ("b", 1, 3), ("a", 1, 3))
    plan = plan_batches(items, 10)
    assert index_groups(plan) == [(0, 2, 4), (1,), (3,)]
    assert plan.batches[1] == Batch("a", (1,), patches=1, act_bytes=50, oversize=True)
    assert [batch.oversize for batch in plan.batches] == [False, True, False]
    assert plan.oversize_count == 1
    check_invariants(plan, items, 10)
    # the neighbours batch exactly as if the oversize item were not there
    without = plan_batches([item for item in items if item.index != 1], 10)
    assert [b for b in plan.batches if not b.oversize] == list(without.batches)


def test_every_item_oversize() -> None:
    items = make(("a", 1, 11), ("a", 1, 12), ("b", 1, 13))
    plan = plan_batches(items, 10)
    assert index_groups(plan) == [(0,), (1,), (2,)]
    assert plan.oversize_count == 3
    check_invariants(plan, items, 10)


def test_item_over_patch_cap_runs_alone_not_oversize() -> None:
    items = make(("a", 2, 1), ("a", 9, 1), ("a", 2, 1))
    plan = plan_batches(items, BIG, max_batch_patches=5)
    assert index_groups(plan) == [(0, 2), (1,)]
    assert plan.oversize_count == 0 and not plan.batches[1].oversize
    check_invariants(plan, items, BIG, max_patches=5)


def test_item_cap_respected() -> None:
    items = make(*[("a", 1, 1)] * 5, ("b", 1, 1))
    plan = plan_batches(items, BIG, max_batch_items=2)
    assert index_groups(plan) == [(0, 1), (2, 3), (4,), (5,)]
    assert plan.max_batch_items == 2
    check_invariants(plan, items, BIG, max_items=2)


def test_patch_cap_respected() -> None:
    items = make(*[("a", patches, 1) for patches in (3, 3, 4, 1, 5)])
    plan = plan_batches(items, BIG, max_batch_patches=7)
    assert index_groups(plan) == [(0, 1), (2, 3), (4,)]
    assert [batch.patches for batch in plan.batches] == [6, 5, 5]
    check_invariants(plan, items, BIG, max_patches=7)


def test_all_limits_together() -> None:
    items = make(*[("a", 2, 3)] * 6)
    plan = plan_batches(items, 9, max_batch_items=4, max_batch_patches=4)
    assert index_groups(plan) == [(0, 1), (2, 3), (4, 5)]
    check_invariants(plan, items, 9, max_items=4, max_patches=4)


def test_locate_and_gather_round_trip_with_shuffled_buckets() -> None:
    buckets = ["x", "y", "z"]
    rng = random.Random(7)
    items = [PlanItem(i, rng.choice(buckets), 1, rng.randint(1, 4)) for i in range(20)]
    plan = plan_batches(items, 6)
    assert [batch.bucket for batch in plan.batches] != [items[0].bucket] * plan.forward_calls
    outputs = [[f"emb{index}" for index in batch.indices] for batch in plan.batches]
    assert plan.gather(outputs) == [f"emb{i}" for i in range(20)]
    for i in range(20):
        number, position = plan.locate(i)
        assert outputs[number][position] == f"emb{i}"


def test_gather_of_a_subset_follows_ascending_indices() -> None:
    items = [PlanItem(7, "a", 1, 1), PlanItem(2, "b", 1, 1), PlanItem(5, "a", 1, 1)]
    plan = plan_batches(items, BIG)
    assert index_groups(plan) == [(2,), (5, 7)]
    assert plan.indices == (2, 5, 7)
    assert plan.gather([["e2"], ["e5", "e7"]]) == ["e2", "e5", "e7"]


def test_locate_unknown_index_raises_key_error() -> None:
    plan = plan_batches(make(("a", 1, 1)), BIG)
    with pytest.raises(KeyError, match="index 3"):
        plan.locate(3)


def test_gather_length_mismatch_names_the_batch() -> None:
    plan = plan_batches(make(("a", 1, 1), ("b", 1, 1), ("b", 1, 1)), BIG)
    with pytest.raises(ValueError, match=r"batch 1 \(bucket 'b'\) has 2 items .* returned 1"):
        plan.gather([["e0"], ["e1"]])
    with pytest.raises(ValueError, match=r"batch 0 .* returned 2"):
        plan.gather([["e0", "extra"], ["e1", "e2"]])


def test_gather_wrong_number_of_batches() -> None:
    plan = plan_batches(make(("a", 1, 1), ("b", 1, 1)), BIG)
    with pytest.raises(ValueError, match="2 batches"):
        plan.gather([["e0"]])


def test_empty_input() -> None:
    plan = plan_batches([], 1)
    assert plan.batches == () and plan.oversize_count == 0
    assert plan.num_items == 0 and plan.forward_calls == 0 and plan.indices == ()
    assert plan.gather([]) == []
    check_invariants(plan, [], 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": 0}, "budget_bytes must be >= 1"),
        ({"budget_bytes": -5}, "budget_bytes must be >= 1"),
        ({"budget_bytes": 1.5}, "budget_bytes must be an int"),
        ({"budget_bytes": True}, "budget_bytes must be an int"),
        ({"max_batch_items": 0}, "max_batch_items must be >= 1"),
        ({"max_batch_patches": 0}, "max_batch_patches must be >= 1"),
        ({"max_batch_patches": "8"}, "max_batch_patches must be an int"),
    ],
)
def test_invalid_limits(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"budget_bytes": 10, **kwargs}
    with pytest.raises(ConfigError, match=message):
        plan_batches(make(("a", 1, 1)), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((0, "a", 0, 1), "item 0: patches must be >= 1"),
        ((0, "a", -1, 1), "item 0: patches must be >= 1"),
        ((0, "a", 1, 0), "item 0: act_bytes must be >= 1"),
        ((0, "a", 1.0, 1), "item 0: patches must be an int"),
        ((0, ["a"], 1, 1), "item 0: bucket must be hashable"),
        ((0, ("a", [1]), 1, 1), "item 0: bucket must be hashable"),
        ((-1, "a", 1, 1), "PlanItem.index must be >= 0"),
        (("0", "a", 1, 1), "PlanItem.index must be an int"),
    ],
)
def test_invalid_items(fields: tuple[object, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanItem(*fields)  # type: ignore[arg-type]


def test_duplicate_index_is_refused() -> None:
    items = [PlanItem(0, "a", 1, 1), PlanItem(1, "a", 1, 1), PlanItem(0, "b", 1, 1)]
    with pytest.raises(ConfigError, match=r"duplicate index 0: items\[0\] and items\[2\]"):
        plan_batches(items, BIG)


def test_non_item_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"items\[1\] must be a PlanItem"):
        plan_batches([PlanItem(0, "a", 1, 1), (1, "a", 1, 1)], BIG)  # type: ignore[list-item]


def test_inconsistent_batches_and_plans_are_refused() -> None:
    with pytest.raises(ConfigError, match="only a batch of one item"):
        Batch("a", (0, 1), patches=2, act_bytes=2, oversize=True)
    with pytest.raises(ConfigError, match="at least one item"):
        Batch("a", (), patches=0, act_bytes=0, oversize=False)
    one = Batch("a", (0,), patches=1, act_bytes=1, oversize=False)
    with pytest.raises(ConfigError, match="index 0 is in batch 0 and in batch 1"):
        Plan((one, one), budget_bytes=1, oversize_count=0)
    with pytest.raises(ConfigError, match="oversize_count"):
        Plan((one,), budget_bytes=1, oversize_count=1)


def test_deterministic_and_independent_of_argument_order() -> None:
    items = make(("a", 2, 4), ("b", 1, 7), ("a", 3, 5), ("c", 1, 30), ("b", 2, 2), ("a", 1, 3))
    first = plan_batches(items, 10, max_batch_items=2)
    assert plan_batches(items, 10, max_batch_items=2) == first
    assert plan_batches(tuple(items), 10, max_batch_items=2) == first
    shuffled = list(items)
    random.Random(3).shuffle(shuffled)
    assert plan_batches(shuffled, 10, max_batch_items=2) == first
    assert plan_batches(iter(items), 10, max_batch_items=2) == first  # type: ignore[arg-type]
    assert items == make(
        ("a", 2, 4), ("b", 1, 7), ("a", 3, 5), ("c", 1, 30), ("b", 2, 2), ("a", 1, 3)
    )


def test_random_inputs_keep_every_invariant() -> None:
    for seed in range(400):
        rng = random.Random(seed)
        n = rng.randint(0, 40)
        buckets: list[Hashable] = ["a", "b", (224, 224), 3][: rng.randint(1, 4)]
        budget = rng.randint(1, 60)
        max_items = rng.choice([None, rng.randint(1, 6)])
        max_patches = rng.choice([None, rng.randint(1, 30)])
        indices = rng.sample(range(3 * n + 1), n)  # sparse, unsorted, unique
        items = [
            PlanItem(index, rng.choice(buckets), rng.randint(1, 12), rng.randint(1, 25))
            for index in indices
        ]
        plan = plan_batches(items, budget, max_batch_items=max_items, max_batch_patches=max_patches)
        context = f"seed {seed}"
        try:
            check_invariants(plan, items, budget, max_items, max_patches)
        except AssertionError as exc:
            raise AssertionError(f"{context}: {plan}") from exc
        again = plan_batches(
            list(reversed(items)), budget, max_batch_items=max_items, max_batch_patches=max_patches
        )
        assert again == plan, context


def test_module_imports_only_the_standard_library() -> None:
    tree = ast.parse(Path(planner.__file__).read_text())
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    outside = {name for name in modules if name.split(".")[0] not in sys.stdlib_module_names}
    assert outside == {"vitserve.errors"}
