"""Serve's request router for the encoder deployment: :mod:`~vitserve.deployments.encoder.routing`
fed from Serve's ``RequestRouter`` hooks (``encoder.routing: work``, the default).

Serve makes one router per handle (the ingress's handle to the encoder, in each ingress
replica) and asks it, per call, for a preference order of replicas; it sends the call to the
first one whose queue is not full, retrying with backoff while all are. This class:

* reads the call's :class:`~vitserve.deployments.encoder.routing.RouteHint` from its first
  argument (an :class:`~vitserve.deployments.encoder.wire.EncodeBatch` carries its keys and
  patches; any other call has an empty hint and goes by load);
* reads each replica's reported load from its routing stats
  (``EncoderDeployment.record_routing_stats``, every :data:`STATS_PERIOD_S`);
* counts a call on its replica from the moment Serve assigns it until Serve reports it
  completed (``on_request_completed``, which Serve fires exactly once per dispatched call).

Invariants: the order returned names every candidate once (the policy's invariant); a call
whose assignment Serve never dispatches stops counting after the policy's ``forget_after_s``;
the router never blocks (no I/O of its own: Serve probes queue lengths).

It subclasses Serve's public ``RequestRouter`` and overrides one private method,
``_fulfill_next_pending_request``, and calls another, ``_get_pending_request_matching_internal_
request_id`` (where the chosen replica meets its call, in Ray 2.60; ``on_request_routed`` fires
only under the rejection protocol). ``tests/deployments/
test_routing_serve.py`` runs it in a real Serve application, so a Ray upgrade that moves it fails
there.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vitserve.deployments.encoder.routing import (
    DEFAULT_BALANCE,
    THIS_CALLER,
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

    def initialize_state(self, balance: float = DEFAULT_BALANCE, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"unknown request_router_kwargs: {sorted(kwargs)}")
        self.routing = WorkRouting(balance=balance, me=THIS_CALLER)

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
        tie = ""
        if pending_request is not None:
            tie = pending_request.metadata.internal_request_id
            # every replica with room is named: when none has (or all queues are full), back
            # off before asking again
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[r]] for r in routing.choose(hint, list(by_id), tie)]

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        pending = self._get_pending_request_matching_internal_request_id(request_metadata)
        if pending is not None:  # the call this replica was chosen for, still waiting
            call = pending.metadata.internal_request_id
            work = hint_of(pending).work
            self._state().routed(call, replica.replica_id.unique_id, work, time.monotonic())
        super()._fulfill_next_pending_request(replica, request_metadata)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._state().completed(internal_request_id, replica_id.unique_id)


__all__ = ["ROUTER_PATH", "STATS_PERIOD_S", "EncoderRequestRouter", "hint_of"]
