"""Which encoder replica an encode call goes to, and when: by the work queued there and by its
images' keys.

**The rule.** A call's *work* is the patches of the images it sends (the ingress reads them from
the images' headers before any pixel is decoded). A replica's *load* is the work that is on it
and not done: what this router sent it and has not seen complete (known at once), plus what
other routers' calls hold there as the replica last reported (its admitted patches by caller,
every ``STATS_PERIOD_S``: one ingress replica, one router, or several). A replica has
*room* while its load is below the room it reports (two device steps' worth of patches: one
running, one ready; a replica that has not reported its room yet, new or late, has room only
while its load is 0: a burst sent at a pool whose first reports are late on a loaded host would
otherwise all go at once, past admission, as 429s). A call goes only to a replica with
room; while none has, it waits in the router (Serve's queue of the handle, bounded by the
deployment's ``max_queued_requests``) and goes to the first replica that makes room. So a
backlog is one queue in front of the pool, which a new replica starts taking from at once, not a
queue per replica that only its own replica can work off. A call waits so at most ``hold_s``:
then it goes to the least loaded replica, room or not, and that replica's admission answers it
(admits it, or refuses it with a 429), so the router never adds more than ``hold_s`` to an
admitted call's latency and an overload is refused, not queued.

Among the replicas with room: each image key has an *owner*, the replica with the highest
rendezvous hash of (key, replica id), so a key keeps its owner while replicas come and go (only
the keys of a replica that left move). A call goes to the owner of most of its work when that
owner has room and is within the bound

    load(owner) <= balance * (total load + work) / replicas

(consistent hashing with bounded load: an owner may carry ``balance`` times the mean, counting
the call itself), else to the replica with room and the least load. So a thumbnail never queues
behind a large image while another replica is idler than the bound allows, and an image sent
again, or by two requests at once, lands where its flight and its replica's local store tier are.

The answer is a preference order over the replicas with room that are within the bound, best
first (empty: wait); the least loaded replica with room is always in it. Serve sends the call
to the first one whose queue is not full (``max_ongoing_requests``) and that answers its queue
probe in time: a replica past the bound is left out because Serve skips a replica whose probe
is late (a busy replica on a loaded host), and falling through to the replica that holds a large
image is what puts a thumbnail behind it. Serve backs off and asks again instead.

Invariants:

* ``choose`` returns distinct candidates with room, within the bound, and always the least
  loaded one with room; a call of any size goes to a replica with room (room is judged on the
  load before the call), so no call waits forever behind its own size. A call that has waited
  ``hold_s`` gets the candidates by load, room or not. A call without keys (no work: a control
  call) gets every candidate, never waits, and is spread by its ``tie``, not by load: a
  replica's stale report never keeps it from another.
* Bookkeeping only: no I/O, no clock of its own (times are passed in), no Ray (it imports
  only its default hold from the config). The Serve adapter
  (:mod:`~vitserve.deployments.encoder.request_router`) feeds it.
* A call counts on one replica from ``routed`` until ``completed`` (each once, any order of
  different calls); a call never completed stops counting after ``forget_after_s`` (a caller
  that went away before its call was sent), so nothing grows without bound.
* Ties (equal load) go to the higher rendezvous rank of the call's first key, so the choice is
  a function of the keys, the loads and the replica set (and of a control call's ``tie``),
  never of arrival order or chance.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vitserve.deployments.common.config import DEFAULT_ROUTING_HOLD_S

#: Serve-side names of a replica's routing stats (``EncoderDeployment.record_routing_stats``).
ADMITTED_PATCHES = "admitted_patches"
BY_CALLER = "by_caller"  # admitted patches by the caller (router) that sent them
ROOM_PATCHES = "room_patches"

#: This process's name as a caller of the encoder: the ingress's flow puts it on each
#: ``EncodeBatch`` and the router in the same process knows its own calls by it.
THIS_CALLER = uuid.uuid4().hex

#: How far above the mean load an owner may be and still get its keys (see the rule).
DEFAULT_BALANCE = 1.25
#: A routed call that never completes stops counting after this long.
DEFAULT_FORGET_AFTER_S = 600.0
#: The longest a call waits in the router for a replica with room (see the rule).
DEFAULT_HOLD_S = DEFAULT_ROUTING_HOLD_S


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What a call tells the router: its images' keys and each one's patches (same order).
    An empty hint (a call that is not an encode) is routed by load alone."""

    keys: tuple[str, ...] = ()
    patches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.patches):
            raise ValueError("a route hint has one patch count per key")
        if any(p < 0 for p in self.patches):
            raise ValueError("patch counts are not negative")

    @property
    def work(self) -> int:
        return sum(self.patches)


def rendezvous_rank(key: str, replica: str) -> int:
    """The key's weight on a replica (highest random weight hashing): a stable 64-bit value."""
    digest = hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class _Routed:
    work: int
    at: float


@dataclass(slots=True)
class WorkRouting:
    """The router's state: the calls it sent and not yet saw complete, and the replicas'
    reported loads. One event loop calls it (the handle's router)."""

    balance: float = DEFAULT_BALANCE
    forget_after_s: float = DEFAULT_FORGET_AFTER_S
    hold_s: float = DEFAULT_HOLD_S
    me: str = ""  # this router's name as a caller (its process's ``THIS_CALLER``)
    _routed: dict[tuple[str, str], _Routed] = field(default_factory=dict)
    _local: dict[str, int] = field(default_factory=dict)
    _reported: dict[str, int] = field(default_factory=dict)
    _room: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.balance < 1.0:
            raise ValueError(f"balance is at least 1 (the mean load), got {self.balance}")
        if self.forget_after_s <= 0:
            raise ValueError("forget_after_s is positive")
        if self.hold_s < 0:
            raise ValueError("hold_s is not negative")

    # -- what the router learns ----------------------------------------------------------------
    def routed(self, call: str, replica: str, work: int, now: float) -> None:
        """``call`` (an id unique per call) was sent to ``replica``; it counts there until
        :meth:`completed`. Routing the same call to the same replica again replaces it."""
        self.completed(call, replica)
        if work <= 0:  # nothing to count (a control call)
            return
        self._routed[call, replica] = _Routed(work, now)
        self._local[replica] = self._local.get(replica, 0) + work

    def completed(self, call: str, replica: str) -> None:
        """``call`` on ``replica`` ended (answered, failed or cancelled); unknown calls are
        ignored (a call this router did not count)."""
        done = self._routed.pop((call, replica), None)
        if done is not None:
            left = self._local.get(replica, 0) - done.work
            if left > 0:
                self._local[replica] = left
            else:
                self._local.pop(replica, None)

    def reported(self, stats: Mapping[str, Mapping[str, object]]) -> None:
        """The replicas' latest routing stats, by replica id: the patches other callers' calls
        hold there (all admitted patches, less this router's own, which it counts itself), and
        the room (a replica with none reported holds nothing of others' and has room while
        nothing of this router's is on it)."""
        self._reported, self._room = {}, {}
        for replica, s in stats.items():
            value, room, mine = s.get(ADMITTED_PATCHES), s.get(ROOM_PATCHES), 0
            by_caller = s.get(BY_CALLER)
            if isinstance(by_caller, Mapping):
                mine = by_caller.get(self.me, 0)
            if isinstance(value, int | float) and value - mine > 0:
                self._reported[replica] = int(value - mine)
            if isinstance(room, int | float) and room > 0:
                self._room[replica] = int(room)

    def forget_stale(self, now: float) -> int:
        """Drop calls routed over ``forget_after_s`` ago and never completed; how many."""
        stale = [c for c, r in self._routed.items() if now - r.at > self.forget_after_s]
        for call, replica in stale:
            self.completed(call, replica)
        return len(stale)

    def load(self, replica: str) -> int:
        return self._local.get(replica, 0) + self._reported.get(replica, 0)

    def has_room(self, replica: str) -> bool:
        room = self._room.get(replica)
        return self.load(replica) < (1 if room is None else room)

    # -- the choice ----------------------------------------------------------------------------
    def owner(self, hint: RouteHint, candidates: Sequence[str]) -> str | None:
        """The candidate that owns most of the call's work (each key's highest rendezvous rank;
        ties to the owner of the earlier key), or None for a call with no keys."""
        if not hint.keys or not candidates:
            return None
        owned: dict[str, int] = {}
        for key, patches in zip(hint.keys, hint.patches, strict=True):
            top = max(candidates, key=functools.partial(rendezvous_rank, key))
            # +1: a key of zero patches (its header did not read) still counts for its owner
            owned[top] = owned.get(top, 0) + patches + 1
        return max(owned, key=owned.__getitem__)  # dicts keep insertion order: ties to first

    def choose(
        self, hint: RouteHint, candidates: Sequence[str], tie: str = "", waited_s: float = 0.0
    ) -> list[str]:
        """The replicas to try, best first; empty: the call waits (see the rule). ``waited_s``
        is how long the call has waited so far. A call without keys carries no work (a
        replica's ``describe`` or ``counters``): it is never held and goes to any replica, in
        the order of ``tie``'s rendezvous ranks (the adapter passes the call's id, so such
        calls spread over the replicas whatever their load)."""
        if not hint.keys:  # a control call (describe, counters): no work, anywhere, spread
            return sorted(candidates, key=lambda r: (-rendezvous_rank(tie, r), r))
        roomy = [r for r in candidates if self.has_room(r)]
        if not roomy:
            if waited_s < self.hold_s:
                return []
            roomy = list(candidates)  # held long enough: the least loaded's admission answers
        tie_key = hint.keys[0]
        by_load = sorted(roomy, key=lambda r: (self.load(r), -rendezvous_rank(tie_key, r), r))
        total = sum(self.load(r) for r in candidates) + hint.work
        bound = self.balance * total / len(candidates)
        within = [by_load[0], *(r for r in by_load[1:] if self.load(r) <= bound)]
        owner = self.owner(hint, candidates)
        if owner is not None and owner in within and self.load(owner) <= bound:
            return [owner, *(r for r in within if r != owner)]
        return within


__all__ = [
    "ADMITTED_PATCHES",
    "BY_CALLER",
    "DEFAULT_BALANCE",
    "DEFAULT_FORGET_AFTER_S",
    "DEFAULT_HOLD_S",
    "ROOM_PATCHES",
    "THIS_CALLER",
    "RouteHint",
    "WorkRouting",
    "rendezvous_rank",
]
