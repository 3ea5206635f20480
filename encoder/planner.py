"""Pure batch planner of the vision tower: which items share which forward call.

One encode call brings items (an image, a video clip, a tile of one), each with a *bucket* (items
may share a forward only when their buckets are equal: same resolution, same model, same dtype,
whatever the caller's batching key is), a patch count and an estimate of the peak activation
bytes its share of a forward needs. :func:`plan_batches` groups them into batches under an
activation budget and optional caps; :class:`Plan` maps every input back to its batch and puts the
per-batch outputs back in input order.

The module is bookkeeping only, in the manner of vLLM's ``EncoderCacheManager``: no I/O, no
tensors, no clock, no randomness; it imports only the standard library and
:mod:`vitserve.errors`. Arguments are validated eagerly (:class:`PlanItem` when it is built,
:func:`plan_batches` before it plans) and anything invalid raises
:class:`~vitserve.errors.ConfigError`.

*Input order* is ascending ``PlanItem.index`` (the index is the item's position in the caller's
input list), so the order in which the items are passed does not change the plan.

Invariants of every plan returned by :func:`plan_batches`:

1. Coverage. Every input index appears in exactly one batch, exactly once. Duplicate indices in
   the input raise ``ConfigError``.
2. One bucket per batch. All items of a batch have equal buckets (``Batch.bucket``).
3. Limits. A batch's ``act_bytes`` is at most ``budget_bytes``, its item count at most
   ``max_batch_items`` and its patch count at most ``max_batch_patches`` (caps that are given),
   except for a batch of exactly one item that alone exceeds a limit. Such an item is never
   refused or dropped: it runs alone, and the other items are batched exactly as if it were not
   there. When it alone exceeds the budget its batch has ``oversize=True`` and counts in
   ``Plan.oversize_count``; ``oversize`` is never set on any other batch. (An item whose patches
   alone exceed ``max_batch_patches`` but whose bytes fit the budget also runs alone, with
   ``oversize=False``.)
4. Determinism. The plan is a pure function of the arguments. Buckets appear in the order of
   their first item in input order; within a bucket, batches are ordered by their first index,
   and items are filled next-fit in input order: an item joins the bucket's open batch when the
   batch stays within every limit, else that batch is closed and the item opens a new one.
   ``Batch.indices`` ascend.
5. Empty input gives an empty plan: no batches, ``oversize_count == 0``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from vitserve.errors import ConfigError

__all__ = ["Batch", "Plan", "PlanItem", "plan_batches"]

T = TypeVar("T")


def _require_int(name: str, value: object, *, minimum: int) -> None:
    """Raise ConfigError unless ``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One input of the planner; validated when built.

    ``index`` is the item's position in the caller's input list (>= 0), ``bucket`` its batching
    key (hashable; items share a batch only when their buckets are equal), ``patches`` its tower
    input patches (> 0) and ``act_bytes`` the estimated peak activation bytes of its share of a
    forward (> 0).
    """

    index: int
    bucket: Hashable
    patches: int
    act_bytes: int

    def __post_init__(self) -> None:
        _require_int("PlanItem.index", self.index, minimum=0)
        try:
            hash(self.bucket)
        except TypeError as exc:
            raise ConfigError(
                f"item {self.index}: bucket must be hashable, "
                f"got {type(self.bucket).__name__} {self.bucket!r}"
            ) from exc
        _require_int(f"item {self.index}: patches", self.patches, minimum=1)
        _require_int(f"item {self.index}: act_bytes", self.act_bytes, minimum=1)


@dataclass(frozen=True, slots=True)
class Batch:
    """One forward call: items of one bucket, ``indices`` in ascending input order.

    ``patches`` and ``act_bytes`` are sums over the items. ``oversize`` is True only for a batch
    of exactly one item whose ``act_bytes`` exceeds the plan's budget.
    """

    bucket: Hashable
    indices: tuple[int, ...]
    patches: int
    act_bytes: int
    oversize: bool

    def __post_init__(self) -> None:
        if not self.indices:
            raise ConfigError("a batch must hold at least one item")
        if self.oversize and len(self.indices) != 1:
            raise ConfigError(
                f"only a batch of one item can be oversize, got {len(self.indices)} items"
            )

    @property
    def num_items(self) -> int:
        """How many items the batch holds."""
        return len(self.indices)


@dataclass(frozen=True, slots=True)
class Plan:
    """The batches of one encode call, and the map from input index to batch and back.

    Built by :func:`plan_batches`. ``budget_bytes``, ``max_batch_items`` and
    ``max_batch_patches`` record the limits it was planned under.
    """

    batches: tuple[Batch, ...]
    budget_bytes: int
    oversize_count: int
    max_batch_items: int | None = None
    max_batch_patches: int | None = None
    # input index -> (batch number, position in batch), in ascending index order
    _where: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where: dict[int, tuple[int, int]] = {}
        for number, batch in enumerate(self.batches):
            for position, index in enumerate(batch.indices):
                if index in where:
                    raise ConfigError(
                        f"index {index} is in batch {where[index][0]} and in batch {number}"
                    )
                where[index] = (number, position)
        counted = sum(batch.oversize for batch in self.batches)
        if counted != self.oversize_count:
            raise ConfigError(
                f"oversize_count is {self.oversize_count} but {counted} batches are oversize"
            )
        object.__setattr__(self, "_where", dict(sorted(where.items())))

    @property
    def num_items(self) -> int:
        """How many items the plan covers."""
        return len(self._where)

    @property
    def forward_calls(self) -> int:
        """How many forward calls the plan makes (one per batch)."""
        return len(self.batches)

    @property
    def indices(self) -> tuple[int, ...]:
        """Every input index of the plan, ascending: the order :meth:`gather` returns."""
        return tuple(self._where)

    def locate(self, index: int) -> tuple[int, int]:
        """``(batch number, position in that batch)`` of input ``index``; KeyError if absent."""
        try:
            return self._where[index]
        except KeyError:
            raise KeyError(f"index {index!r} is not in this plan") from None

    def gather(self, per_batch_outputs: Sequence[Sequence[T]]) -> list[T]:
        """Reassemble per-batch outputs into one list in input order (ascending index).

        ``per_batch_outputs[b][p]`` is the output of the item at position ``p`` of batch ``b``.
        Element ``k`` of the result belongs to input index ``self.indices[k]``; when the indices
        are ``0..n-1`` that is simply input ``k``. Raises ValueError when the number of batches
        differs, or naming the batch whose output length differs from its item count.
        """
        if len(per_batch_outputs) != len(self.batches):
            raise ValueError(
                f"the plan has {len(self.batches)} batches but outputs for "
                f"{len(per_batch_outputs)} batches were given"
            )
        for number, (batch, outputs) in enumerate(
            zip(self.batches, per_batch_outputs, strict=True)
        ):
            if len(outputs) != len(batch.indices):
                raise ValueError(
                    f"batch {number} (bucket {batch.bucket!r}) has {len(batch.indices)} items "
                    f"but its forward returned {len(outputs)} outputs; the forward must return "
                    f"exactly one output per input"
                )
        return [per_batch_outputs[number][position] for number, position in self._where.values()]


class _OpenBatch:
    """The batch a bucket is currently filling (mutable; internal to plan_batches)."""

    __slots__ = ("act_bytes", "items", "patches")

    def __init__(self) -> None:
        self.items: list[PlanItem] = []
        self.patches = 0
        self.act_bytes = 0

    def add(self, item: PlanItem) -> None:
        self.items.append(item)
        self.patches += item.patches
        self.act_bytes += item.act_bytes


def _make_batch(items: Sequence[PlanItem], budget_bytes: int) -> Batch:
    act_bytes = sum(item.act_bytes for item in items)
    return Batch(
        bucket=items[0].bucket,
        indices=tuple(item.index for item in items),
        patches=sum(item.patches for item in items),
        act_bytes=act_bytes,
        oversize=len(items) == 1 and act_bytes > budget_bytes,
    )


def plan_batches(
    items: Sequence[PlanItem],
    budget_bytes: int,
    *,
    max_batch_items: int | None = None,
    max_batch_patches: int | None = None,
) -> Plan:
    """Group ``items`` into forward calls; see the module docstring for the invariants.

    ``budget_bytes`` (> 0) bounds the summed ``act_bytes`` of a batch; ``max_batch_items`` and
    ``max_batch_patches`` (> 0 when given) bound its item and patch counts. Raises ConfigError for
    an invalid argument or a duplicate index. O(n log n) in the number of items.
    """
    _require_int("budget_bytes", budget_bytes, minimum=1)
    if max_batch_items is not None:
        _require_int("max_batch_items", max_batch_items, minimum=1)
    if max_batch_patches is not None:
        _require_int("max_batch_patches", max_batch_patches, minimum=1)

    given = list(items)
    seen: dict[int, int] = {}
    for position, item in enumerate(given):
        if not isinstance(item, PlanItem):
            raise ConfigError(
                f"items[{position}] must be a PlanItem, got {type(item).__name__} {item!r}"
            )
        if item.index in seen:
            raise ConfigError(
                f"duplicate index {item.index}: items[{seen[item.index]}] and items[{position}]"
            )
        seen[item.index] = position

    by_bucket: dict[Hashable, list[PlanItem]] = {}  # insertion order = first appearance
    for item in sorted(given, key=lambda item: item.index):
        by_bucket.setdefault(item.bucket, []).append(item)

    def alone_exceeds(item: PlanItem) -> bool:
        return item.act_bytes > budget_bytes or (
            max_batch_patches is not None and item.patches > max_batch_patches
        )

    def fits(open_batch: _OpenBatch, item: PlanItem) -> bool:
        if open_batch.act_bytes + item.act_bytes > budget_bytes:
            return False
        if max_batch_items is not None and len(open_batch.items) + 1 > max_batch_items:
            return False
        patches = open_batch.patches + item.patches
        return max_batch_patches is None or patches <= max_batch_patches

    batches: list[Batch] = []
    for bucket_items in by_bucket.values():
        bucket_batches: list[Batch] = []
        open_batch = _OpenBatch()
        for item in bucket_items:
            if alone_exceeds(item):
                # Runs alone; the open batch stays open, so the neighbours batch as without it.
                bucket_batches.append(_make_batch([item], budget_bytes))
                continue
            if open_batch.items and not fits(open_batch, item):
                bucket_batches.append(_make_batch(open_batch.items, budget_bytes))
                open_batch = _OpenBatch()
            open_batch.add(item)
        if open_batch.items:
            bucket_batches.append(_make_batch(open_batch.items, budget_bytes))
        bucket_batches.sort(key=lambda batch: batch.indices[0])
        batches.extend(bucket_batches)

    return Plan(
        batches=tuple(batches),
        budget_bytes=budget_bytes,
        oversize_count=sum(batch.oversize for batch in batches),
        max_batch_items=max_batch_items,
        max_batch_patches=max_batch_patches,
    )
