"""The node-local connection: one Ray actor per node owns the values; readers map them zero-copy.

Every process on a node (encoder replicas, LLM-side readers) opens a :class:`NodeConnection`
(directly, or as the connection of a :class:`NodeStore`, a store over one of its own); they all
talk to one long-lived **store actor** (:mod:`vitserve.cache.node_actor`) on that node, named
``vitserve-node-store-<node id>`` in the Ray namespace ``"vitserve"``, detached, with
``num_cpus=0`` and hard node affinity. The first opener creates it (``get_if_exists=True``, so
concurrent openers race safely to one actor); later openers find it by name.

This module is the client side: the connection, the store over one, and how the actor is found
or created; what the actor holds and guarantees (ownership, the check at put, the budget, the
claims) is :mod:`~vitserve.cache.node_actor`'s. ``BACKEND`` declares the URL it serves
(``node://?max_bytes=4GiB&read_cache_bytes=256MiB``) to the table of :mod:`vitserve.cache.urls`.

Invariants (beyond the actor's, which every connection sees):

* **Reads copy nothing.** ``get_refs`` hands out the ObjectRefs (nested in a list, so the reader
  borrows them); ``ray.get`` of them maps read-only uint8 arrays straight from the node's shared
  object store, and the codec decodes views over them. A reader's arrays stay valid after the
  entry is evicted, replaced or deleted: Ray keeps a borrowed / mapped object alive.
* **Readers keep what they read, briefly.** A content key's value never changes, so each
  ``NodeConnection`` keeps the mapped values it read (``read_cache_bytes``, LRU) for up to
  ``read_cache_s`` seconds (never past the entry's ttl) and serves repeated reads of them
  without an actor call (a prefill reading an image chunk by chunk). The price, bounded by those
  two settings: a delete or an eviction made through another ``NodeConnection`` is seen by this one
  only when its kept copy ages out (its own deletes at once), and kept values stay mapped, so
  the node's object store holds up to ``read_cache_bytes`` per reader beyond ``max_bytes``.
  ``read_cache_bytes=0`` turns it off.
* **Timeouts.** Every actor call and object fetch is bounded by ``timeout_s`` (``wait_for``: its
  own timeout plus ``timeout_s``); a timeout, a dead or restarting actor, or a lost object raises
  :class:`~vitserve.errors.StoreUnavailableError` (retryable) and counts in ``errors``. After the
  actor died, the next call finds or re-creates it by name (empty), so a store heals itself.

Ray is imported at the top of this module and of the actor's; ``import vitserve.cache`` imports
neither (the URL table imports this one when a ``node://`` URL is opened).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vitserve.cache.backend import Backend, Opener, parse_size, take_policy
from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.connection import Buffer, Connection, buffer_nbytes
from vitserve.cache.node_actor import ACTOR_THREADS, DEFAULT_MAX_BYTES, node_store_actor_class
from vitserve.errors import ConfigError, StoreUnavailableError

logger = logging.getLogger(__name__)

#: what each reader keeps of the values it read (see the module docstring)
DEFAULT_READ_CACHE_BYTES = 256 << 20
DEFAULT_READ_CACHE_S = 5.0
#: the Ray namespace of every store actor (independent of the caller's job namespace)
RAY_NAMESPACE = "vitserve"
ACTOR_NAME_PREFIX = "vitserve-node-store-"
# A put_values batch is sent in calls of at most this many bytes (bounds the argument object).
_PUT_CALL_BYTES = 256 << 20


def default_actor_name(node_id: str) -> str:
    """The name of the store actor of the node ``node_id`` (hex)."""
    return f"{ACTOR_NAME_PREFIX}{node_id}"


def _ensure_ray(store: str, timeout_s: float) -> Any:
    """The ``ray`` module, connected: joins a running cluster when this process is not yet.

    ``ray.init`` waits a long time for a cluster address that does not answer, so the address
    is first probed with a TCP connect bounded by ``timeout_s``.
    """
    if ray.is_initialized():
        return ray
    try:
        address = _cluster_address()
        if address is not None:
            host, _, port = address.rpartition(":")
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
        ray.init(address="auto", logging_level=logging.WARNING)
    except Exception as exc:  # ConnectionError when no cluster runs, OSError, ...
        raise StoreUnavailableError(
            store, f"Ray is not initialised and no running Ray cluster was found ({exc})"
        ) from None
    return ray


def _cluster_address() -> str | None:
    """host:port of the cluster ``ray.init(address="auto")`` would join (RAY_ADDRESS, else the
    local one); None where it cannot be told (a Ray client address, Ray internals moved)."""
    if os.environ.get("RAY_ADDRESS", "").startswith("ray://"):
        return None
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:  # pragma: no cover - private API; ray.init still decides
        return None
    return canonicalize_bootstrap_address_or_die("auto")  # ConnectionError when none runs


class NodeConnection(Connection):
    """A client of this node's store actor; see the module docstring for the contract.

    ``actor_name`` defaults to the node's actor; give a private one to get an isolated store
    (it is created on this node if it does not exist). ``timeout_s`` bounds every actor call.
    ``read_cache_bytes`` / ``read_cache_s`` bound what this object keeps of the values it read.
    """

    kind = "node"
    # The actor checks every value in full when it is put; stored objects are sealed and mapped
    # read-only, so reads check headers (key, fingerprint) only.
    verify_payload = False

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        share_bytes: int | None = None,
        actor_name: str | None = None,
        timeout_s: float = 10.0,
        read_cache_bytes: int = DEFAULT_READ_CACHE_BYTES,
        read_cache_s: float = DEFAULT_READ_CACHE_S,
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if read_cache_bytes < 0 or read_cache_s < 0:
            raise ConfigError("read_cache_bytes and read_cache_s may not be negative")
        self.timeout_s = float(timeout_s)
        self.read_cache_bytes = int(read_cache_bytes)
        self.read_cache_s = float(read_cache_s)
        # full key -> (mapped value, monotonic time it must be dropped); LRU order
        self._kept: OrderedDict[str, tuple[np.ndarray, float]] = OrderedDict()
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()
        ray = _ensure_ray(f"{self.kind}({actor_name or 'default'})", self.timeout_s)
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.actor_name = actor_name or default_actor_name(self.node_id)
        self.actor_namespace = RAY_NAMESPACE
        self._requested_max_bytes = int(max_bytes)
        self._requested_share_bytes = None if share_bytes is None else int(share_bytes)
        self._handle: Any = None
        self._handle_lock = threading.Lock()

        info = self._call(
            "configure",
            lambda a: a.configure.remote(self._requested_max_bytes, self._requested_share_bytes),
        )
        self.max_bytes: int = info["max_bytes"]
        self.actor_node_id: str = info["node_id"]
        self.actor_pid: int = info["pid"]
        if info["previous_share_bytes"] != info["share_bytes"]:
            logger.warning(
                "store actor %s: each namespace's share changed from %s to %s bytes by this opener",
                self.actor_name,
                info["previous_share_bytes"],
                info["share_bytes"],
            )
        if info["previous_max_bytes"] != info["max_bytes"]:
            logger.warning(
                "store actor %s: byte budget changed from %d to %d by this opener",
                self.actor_name,
                info["previous_max_bytes"],
                info["max_bytes"],
            )
        if self.actor_node_id != self.node_id:
            logger.warning(
                "store actor %s runs on node %s, not this node %s: reads will copy",
                self.actor_name,
                self.actor_node_id,
                self.node_id,
            )

    def __repr__(self) -> str:
        return f"NodeConnection(actor={self.actor_name!r})"

    @property
    def claim_scope(self) -> str:
        """Its store actor's (a node's, by default): a process on another node opening
        ``node://`` talks to another actor and finds none of these entries or claims."""
        return f"node://{self.actor_name}"

    # -- the actor -----------------------------------------------------------------------------
    @property
    def _label(self) -> str:
        return f"{self.kind}({self.actor_name})"

    def _actor(self) -> Any:
        """The handle of the store actor, found by name or created on this node."""
        with self._handle_lock:
            if self._handle is None:
                try:
                    self._handle = (
                        node_store_actor_class()
                        .options(
                            name=self.actor_name,
                            namespace=RAY_NAMESPACE,
                            get_if_exists=True,
                            lifetime="detached",
                            num_cpus=0,
                            max_concurrency=ACTOR_THREADS,
                            max_restarts=-1,  # a crashed actor comes back (empty)
                            max_task_retries=0,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(
                                self.node_id, soft=False
                            ),
                        )
                        .remote(self._requested_max_bytes, self._requested_share_bytes)
                    )
                except Exception as exc:  # the GCS unreachable, Ray shut down, ...
                    self.counters.add("errors")
                    raise StoreUnavailableError(
                        self._label, f"cannot find or create the store actor: {exc}"
                    ) from None
            return self._handle

    def _forget_actor(self, handle: Any) -> None:
        with self._handle_lock:
            if self._handle is handle:
                self._handle = None

    def _call(self, what: str, submit: Callable[[Any], Any], timeout: float | None = None) -> Any:
        """Submit one actor call and wait for its result, at most ``timeout`` (default
        ``timeout_s``) seconds; every failure to reach the actor -> StoreUnavailableError."""
        handle = self._actor()
        return self._wait(what, lambda: submit(handle), timeout, handle)

    def _wait(
        self, what: str, submit: Callable[[], Any], timeout: float | None, handle: Any = None
    ) -> Any:
        limit = self.timeout_s if timeout is None else timeout
        try:
            return ray.get(submit(), timeout=limit)
        except rex.GetTimeoutError:
            self.counters.add("errors")
            raise StoreUnavailableError(
                self._label, f"{what} timed out after {limit:g} s"
            ) from None
        except (
            rex.RayActorError,
            rex.ActorUnschedulableError,  # its node is gone: it can never come back there
            rex.ObjectLostError,
            rex.RaySystemError,
        ) as exc:
            # The actor died or is restarting, or the objects it owned went with it: the next
            # call looks the actor up again (re-creating it, empty, if it is gone).
            self.counters.add("errors")
            self._forget_actor(handle if handle is not None else self._handle)
            reason = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            raise StoreUnavailableError(self._label, reason) from None

    def _fetch(self, refs: list[Any]) -> list[np.ndarray]:
        """The values of ``refs``: read-only arrays mapping the object store (no copy)."""
        return self._wait("fetch", lambda: refs, None) if refs else []

    # -- backend -------------------------------------------------------------------------------
    def put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        self.put_and_release(items, ttl_s, [])

    def put_and_release(
        self, items: list[tuple[str, Buffer]], ttl_s: float | None, releases: list[tuple[str, str]]
    ) -> None:
        """One actor call per ``_PUT_CALL_BYTES`` of values (one in all, usually); the claims
        are released by the last of them. This reader's kept copies of those keys are
        forgotten: it reads its own writes."""
        if items:
            with self._kept_lock:
                self._drop_kept([fk for fk, _ in items])
        batches: list[list[tuple[str, np.ndarray]]] = [[]]
        size = 0
        for fk, value in items:
            n = buffer_nbytes(value)
            if batches[-1] and size + n > _PUT_CALL_BYTES:
                batches.append([])
                size = 0
            batches[-1].append((fk, np.frombuffer(value, dtype=np.uint8)))  # a view, no copy
            size += n
        handle = self._actor()
        pending = [handle.put.remote(batch, ttl_s) for batch in batches[:-1]]
        pending.append(handle.put.remote(batches[-1], ttl_s, releases))
        self._wait("put", lambda: pending, None, handle)

    # -- reads: what this object read lately, then the actor -------------------------------------
    def _kept_value(self, full_key: str, now: float) -> np.ndarray | None:
        with self._kept_lock:
            kept = self._kept.get(full_key)
            if kept is None:
                return None
            if kept[1] <= now:
                self._drop_kept([full_key])
                return None
            self._kept.move_to_end(full_key)
            return kept[0]

    def _keep(self, full_key: str, value: np.ndarray, until: float) -> None:
        if value.nbytes > self.read_cache_bytes or until <= time.monotonic():
            return
        with self._kept_lock:
            self._drop_kept([full_key])
            while self._kept and self._kept_bytes + value.nbytes > self.read_cache_bytes:
                self._drop_kept([next(iter(self._kept))])
            self._kept[full_key] = (value, until)
            self._kept_bytes += value.nbytes

    def _drop_kept(self, full_keys: list[str]) -> None:
        """Forget kept values (the caller holds ``_kept_lock``, or nobody else can)."""
        for fk in full_keys:
            kept = self._kept.pop(fk, None)
            if kept is not None:
                self._kept_bytes -= kept[0].nbytes

    def get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        now = time.monotonic()
        out: list[Buffer | None] = [self._kept_value(fk, now) for fk in full_keys]
        asked = [i for i, v in enumerate(out) if v is None]
        self.counters.add("read_cache_hits", len(full_keys) - len(asked))
        if not asked:
            return out
        answers = self._call("get_refs", lambda a: a.get_refs.remote([full_keys[i] for i in asked]))
        found = [(i, a) for i, a in zip(asked, answers, strict=True) if a is not None]
        values = self._fetch([ref for _, (ref, _) in found])
        for (i, (_, remaining)), value in zip(found, values, strict=True):
            out[i] = value
            if self.read_cache_bytes and self.read_cache_s:
                keep_s = (
                    self.read_cache_s if remaining is None else min(remaining, self.read_cache_s)
                )
                self._keep(full_keys[i], value, now + keep_s)
        return out

    def exists(self, full_keys: list[str]) -> list[bool]:
        return self._call("exists", lambda a: a.exists.remote(full_keys))

    def get_head(self, full_key: str) -> Buffer | None:
        return self.get_values([full_key])[0]  # the whole value, zero-copy: get_rows slices it

    def get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        return self._call("heads", lambda a: a.heads.remote(full_keys))  # headers only

    def lookup_or_claim(
        self, full_keys: list[str], ttl_s: float, token: str
    ) -> list[Buffer | bool]:
        return self._claiming("lookup_or_claim", full_keys, ttl_s, token)

    def lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        return self._call("states", lambda a: a.states.remote(full_keys))

    def delete(self, full_keys: list[str]) -> int:
        with self._kept_lock:
            self._drop_kept(full_keys)
        return self._call("delete", lambda a: a.delete.remote(full_keys))

    def _give_up_at(self) -> float | None:
        """When the actor must stop granting this caller's claims: a claim that timed out here
        must not be granted later (it would block every waiter until its ttl). Clocks of one
        node agree; across nodes no deadline is sent and the release below must do."""
        return time.time() + self.timeout_s if self.actor_node_id == self.node_id else None

    def _claiming(self, method: str, full_keys: list[str], ttl_s: float, token: str) -> Any:
        """Call the actor's ``claim`` (one key) or ``lookup_or_claim`` (a list). If the call
        fails here, the claims it may have been granted are released (best effort, not waited
        for): the actor refuses them once we gave up, and should it have granted them just
        before, these releases follow."""
        handle = self._actor()
        give_up_at = self._give_up_at()
        arg = full_keys[0] if method == "claim" else full_keys
        submit = lambda: getattr(handle, method).remote(arg, ttl_s, token, give_up_at)  # noqa: E731
        try:
            return self._wait(method, submit, None, handle)
        except StoreUnavailableError:
            for fk in full_keys:
                with contextlib.suppress(Exception):
                    handle.release.remote(fk, token)
            raise

    def claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        return self._claiming("claim", [full_key], ttl_s, token)

    def release(self, full_key: str, token: str) -> None:
        self._call("release", lambda a: a.release.remote(full_key, token))

    def claimed(self, full_key: str) -> bool:
        return self._call("claimed", lambda a: a.claimed.remote(full_key))

    def wait_for(self, full_key: str, timeout_s: float) -> bool:
        """As the base contract, in one actor call that is woken by the key's put, release or
        delete (no polling)."""
        timeout_s = max(0.0, float(timeout_s))
        return self._call(
            "wait_for",
            lambda a: a.wait_for.remote(full_key, timeout_s),
            timeout=timeout_s + self.timeout_s,
        )

    def backend_stats(self) -> dict[str, int]:
        """The actor's counters: node-wide, since the actor started."""
        return self._call("stats", lambda a: a.stats.remote())

    def close(self) -> None:
        """Give up the claims held under this connection's token (best effort) and drop the
        actor handle; the actor and its entries stay."""
        if self._handle is not None:
            with contextlib.suppress(StoreUnavailableError):
                self._call("release_all", lambda a: a.release_all.remote(self.token))
        self._forget_actor(self._handle)

    def kill_actor(self) -> None:
        """Kill the store actor: every entry it holds is gone, for every process on the node
        (tests and operators; the next call re-creates it, empty)."""
        handle = self._actor()
        ray.kill(handle, no_restart=True)
        self._forget_actor(handle)
        with self._kept_lock:
            self._drop_kept(list(self._kept))


class NodeStore(EmbeddingStore):
    """A store over a node-store connection of its own (the connection's options as
    :class:`NodeConnection`)."""

    def __init__(
        self,
        *,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
        **options: Any,
    ) -> None:
        policy = StorePolicy(namespace=namespace, fingerprint=fingerprint, ttl_s=ttl_s)
        super().__init__(NodeConnection(**options), policy, owns_connection=True)


def _from_url(
    url: str, options: dict[str, Any], open_url: Opener
) -> tuple[NodeConnection, StorePolicy]:
    policy = take_policy(options)
    return NodeConnection(**options), policy  # looked up when called: tests stand in for it


BACKEND = Backend(
    schemes=("node",),
    options={
        "max_bytes": parse_size,
        "share_bytes": parse_size,
        "actor_name": str,
        "timeout_s": float,
        "read_cache_bytes": parse_size,
        "read_cache_s": float,
    },
    from_url=_from_url,
)
