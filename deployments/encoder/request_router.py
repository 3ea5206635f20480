"""Serve's request router for the encoder deployment: :mod:`~vitserve.deployments.encoder.routing`
fed from Serve's ``RequestRouter`` hooks (``encoder.routing: work``).

Serve makes one router per handle (the ingress's handle to the encoder, in each ingress
replica) and asks it, per call, for a preference order of replicas; it sends the call to the
first one whose queue is not full, retrying with backoff while all are. This class:

* reads the call's :class:`~vitserve.deployments.encoder.routing.RouteHint` from its first
  argument (an :class:`~vitserve.deployments.encoder.wire.EncodeBatch` carries its keys and
  patches; any other call has an empty hint and goes by load);
* reads each replica's reported load from its routing stats
  (``EncoderDeployment.record_routing_stats``, every :data:`STATS_PERIOD_S`);
* gives a replica that takes a call to the oldest waiting call whose first choice it is, else
  to the call it was found for (FIFO among the calls that prefer it, as Serve's own router is
  FIFO): Serve's routing tasks race for a freed slot, and without this a call that keeps
  losing the race waits through slot after slot (the overload test's admitted p99 is where
  it shows); a call is not given a replica it only takes as a fallback while another call
  prefers it, so a key stays with its owner when calls wait;
* counts a call on its replica from the moment Serve assigns it until Serve reports it
  completed (``on_request_completed``, which Serve fires exactly once per dispatched call),
  and subtracts its own calls from the replicas' reports by the caller name of the process it
  runs in (``routing.THIS_CALLER``, read there: Serve ships this class pickled by value).

Invariants: the order returned names only candidates, each once (the policy's invariant); a
replica goes to the oldest waiting call whose own choice names it first, else to the call it
was found for (whose choice names it); a call whose assignment
Serve never dispatches stops counting after the policy's ``forget_after_s``; the router never
blocks (no I/O of its own: Serve probes queue lengths).

It subclasses Serve's public ``RequestRouter``, overrides one private method,
``_fulfill_next_pending_request``, and reads Serve's private queue of waiting calls,
``_pending_requests_to_fulfill`` (where a chosen replica meets its call, in Ray 2.60;
``on_request_routed`` fires only under the rejection protocol). ``tests/deployments/
test_routing_serve.py`` runs it in a real Serve application, so a Ray upgrade that moves them
fails there.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vitserve.deployments.encoder import routing as routing_module
from vitserve.deployments.encoder.routing import (
    DEFAULT_BALANCE,
    DEFAULT_HOLD_S,
    RouteHint,
    WorkRouting,
)
from vitserve.deployments.encoder.wire import EncodeBatch

#: The request router's import path (Serve loads it by name in each handle's process).
ROUTER_PATH = "vitserve.deployments.encoder.request_router:EncoderRequestRouter"
#: How often each encoder replica's routing stats are read (Serve's default is 10 s).
STATS_PERIOD_S = 1.0
STATS_TIMEOUT_S = 5.0
#: How soon a call waiting for room asks again: Serve backs off from the first to the last,
#: doubling (its defaults, 25 ms to 0.5 s, would leave a replica idle up to half a second).
BACKOFF_S = (0.005, 0.05)


def hint_of(pending: PendingRequest | None) -> RouteHint:
    """The call's route hint: its ``EncodeBatch``'s, or empty."""
    if pending is None or not pending.args:
        return RouteHint()
    batch = pending.args[0]
    return batch.route_hint() if isinstance(batch, EncodeBatch) else RouteHint()


class EncoderRequestRouter(RequestRouter):
    """Routes encoder calls by work and by key (see the module docstring)."""

    routing: WorkRouting
    _candidates: list[str]  # the replicas of the last choice (Serve's candidates)

    def initialize_state(
        self, balance: float = DEFAULT_BALANCE, hold_s: float = DEFAULT_HOLD_S, **kwargs: Any
    ) -> None:
        if kwargs:
            raise TypeError(f"unknown request_router_kwargs: {sorted(kwargs)}")
        # This process's caller name, read from the routing module at run time: Serve ships
        # this class pickled by value (RequestRouterConfig registers its module with
        # cloudpickle), so a name imported into this module would be the deploying process's,
        # never matching the calls' (the module object itself travels by reference).
        me = routing_module.THIS_CALLER
        self.routing = WorkRouting(balance=balance, hold_s=hold_s, me=me)
        self._candidates = []

    def _state(self) -> WorkRouting:
        # Serve calls initialize_state right after constructing the router; a router made
        # without it (Serve's own tests do that) gets the defaults.
        if not hasattr(self, "routing"):
            self.initialize_state()
        return self.routing

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        routing = self._state()
        routing.forget_stale(time.monotonic())
        routing.reported({r.replica_id.unique_id: r.routing_stats for r in candidate_replicas})
        hint = hint_of(pending_request)
        tie, waited_s = "", 0.0
        if pending_request is not None:
            tie = pending_request.metadata.internal_request_id
            waited_s = time.time() - pending_request.created_at  # Serve stamps it with time.time
            # every replica with room is named: when none has (or all queues are full), back
            # off before asking again
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._candidates = list(by_id)
        return [[by_id[r]] for r in routing.choose(hint, self._candidates, tie, waited_s)]

    def _oldest_pending_for(self, replica: str) -> PendingRequest | None:
        """The oldest waiting call whose first choice now is ``replica`` (FIFO among the calls
        that prefer it, as Serve's own router is FIFO), or None."""
        routing, now = self._state(), time.time()
        for pending in self._pending_requests_to_fulfill:
            if pending.future.done():
                continue
            tie, waited_s = pending.metadata.internal_request_id, now - pending.created_at
            order = routing.choose(hint_of(pending), self._candidates, tie, waited_s)
            if order and order[0] == replica:
                return pending
        return None

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        replica_id = replica.replica_id.unique_id
        pending = self._oldest_pending_for(replica_id)
        if pending is None:  # the call this replica was chosen for, if still waiting
            pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        if pending is None:
            return
        call = pending.metadata.internal_request_id
        self._state().routed(call, replica_id, hint_of(pending).work, time.monotonic())
        super()._fulfill_next_pending_request(replica, pending.metadata)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._state().completed(internal_request_id, replica_id.unique_id)


__all__ = ["ROUTER_PATH", "STATS_PERIOD_S", "EncoderRequestRouter", "hint_of"]
