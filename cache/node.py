"""The node-local store: one Ray actor per node owns the values; readers map them zero-copy.

Every process on a node (encoder replicas, LLM-side readers) opens a :class:`NodeStore`; they all
talk to one long-lived **store actor** (:class:`NodeStoreActor`) on that node, named
``vitserve-node-store-<node id>`` in the Ray namespace ``"vitserve"``, detached, with
``num_cpus=0`` and hard node affinity. The first opener creates it (``get_if_exists=True``, so
concurrent openers race safely to one actor); later openers find it by name.

Invariants:

* **Ownership.** The actor calls ``ray.put`` for every value, so the actor, not the publishing
  process, owns the objects. An entry therefore **survives the death of the replica that
  published it** (an object ``ray.put`` by the replica itself would be lost with it:
  ``OwnerDiedError``). Entries die with the actor (or are lost if the node dies).
* **Writes cost two copies in Ray** (on top of the one :func:`~vitserve.cache.codec.encode_record`
  makes), once per image: the caller's value travels as a task argument (for values over Ray's
  100 KiB inline limit Ray copies it into the object store, owned by the caller, and frees it
  when the call returns), and the actor ``ray.put`` s it, copying it into an object it owns.
  The second copy is the price of ownership: Ray cannot transfer an object's ownership
  (``ray.put(_owner=...)`` is gone), and only a copy made by the actor survives the writer.
* **Reads copy nothing.** ``get_refs`` hands out the ObjectRefs (nested in a list, so the reader
  borrows them); ``ray.get`` of them maps read-only uint8 arrays straight from the node's shared
  object store, and the codec decodes views over them. A reader's arrays stay valid after the
  entry is evicted, replaced or deleted: Ray keeps a borrowed / mapped object alive.
* **Budget, LRU, TTL** exactly as :mod:`vitserve.cache.memory`, but node-wide: the bytes held
  never exceed ``max_bytes`` after a put returns (least recently used entries go first; a value
  larger than the budget is refused and counted in ``too_large``); an expired entry is never
  returned. The budget is the actor's: whoever opens a store with another ``max_bytes`` resizes
  it (with a warning). Keep ``max_bytes`` well below the node's object store memory, or Ray
  spills entries to disk (still correct, no longer zero-copy).
* **Claims** live in the actor: full key -> (deadline, token); the token is per ``NodeStore``
  object, so only the claimant's ``release`` counts; a claim whose caller timed out is never
  granted behind its back. ``wait_for`` is one actor call that sleeps on an ``asyncio.Event``
  per key, woken by the put / release / delete of that key.
* **Timeouts.** Every actor call and object fetch is bounded by ``timeout_s`` (``wait_for``: its
  own timeout plus ``timeout_s``); a timeout, a dead or restarting actor, or a lost object raises
  :class:`~vitserve.errors.StoreUnavailableError` (retryable) and counts in ``errors``. After the
  actor died, the next call finds or re-creates it by name (empty), so a store heals itself.

Ray is imported lazily (here only inside functions), so ``import vitserve.cache`` stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vitserve.cache.base import Buffer, EmbeddingStore, buffer_nbytes
from vitserve.cache.lru import ByteBudgetLru
from vitserve.errors import ConfigError, StoreUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30
#: the Ray namespace of every store actor (independent of the caller's job namespace)
RAY_NAMESPACE = "vitserve"
ACTOR_NAME_PREFIX = "vitserve-node-store-"
#: concurrent calls one store actor serves (it is an async actor: waiters cost no thread)
ACTOR_MAX_CONCURRENCY = 1000
# A put_values batch is sent in calls of at most this many bytes (bounds the argument object).
_PUT_CALL_BYTES = 256 << 20


def default_actor_name(node_id: str) -> str:
    """The name of the store actor of the node ``node_id`` (hex)."""
    return f"{ACTOR_NAME_PREFIX}{node_id}"


# -- the actor ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Claim:
    deadline: float
    token: str


class _Wake:
    """Wakes everyone waiting on one key."""

    __slots__ = ("event", "waiters")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.waiters = 0


class NodeStoreActor:
    """The per-node index and owner of the values (an async Ray actor; wrap with
    :func:`node_store_actor_class`). State is touched only on the event loop, so needs no lock;
    the only slow step, copying values into owned objects, runs in a thread."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import ray

        self._ray = ray
        self._lru = ByteBudgetLru(max_bytes)  # full key -> ObjectRef owned by this actor
        self._claims: dict[str, _Claim] = {}
        self._wakes: dict[str, _Wake] = {}
        self._node_id = ray.get_runtime_context().get_node_id()

    # -- helpers -------------------------------------------------------------------------------
    def _notify(self, fk: str) -> None:
        wake = self._wakes.pop(fk, None)
        if wake is not None:
            wake.event.set()

    def _live_claim(self, fk: str, now: float) -> _Claim | None:
        claim = self._claims.get(fk)
        if claim is not None and claim.deadline <= now:
            del self._claims[fk]
            return None
        return claim

    # -- methods -------------------------------------------------------------------------------
    async def configure(self, max_bytes: int) -> dict[str, Any]:
        """Set the byte budget (evicting to fit) and describe the actor."""
        previous = self._lru.max_bytes
        self._lru.resize(max_bytes)  # evicts to fit a smaller budget
        return {"max_bytes": self._lru.max_bytes, "previous_max_bytes": previous,
                "node_id": self._node_id, "pid": os.getpid()}  # fmt: skip

    async def put(self, items: list[tuple[str, np.ndarray]], ttl_s: float | None) -> None:
        """Copy each value into an object this actor owns and index it (replacing any)."""
        ray = self._ray
        sizes = [int(v.nbytes) for _, v in items]
        # Ray owns what the actor puts: this copy is what lets the value outlive its writer.
        refs = await asyncio.to_thread(
            lambda: [ray.put(v) if n <= self._lru.max_bytes else None
                     for (_, v), n in zip(items, sizes, strict=True)]
        )  # fmt: skip
        now = time.monotonic()
        expires = now + ttl_s if ttl_s is not None else None
        for (fk, _), ref, size in zip(items, refs, sizes, strict=True):
            # A value over the budget (even if it shrank meanwhile) is refused: too_large.
            self._lru.put(fk, ref, size, expires)
            self._notify(fk)

    async def get_refs(self, full_keys: list[str]) -> list[Any]:
        """The ObjectRefs of the keys (None where missing), nested so the caller borrows them;
        marks them recently used."""
        now = time.monotonic()
        out = []
        for fk in full_keys:
            out.append(self._lru.get(fk, now))
        return out

    async def exists(self, full_keys: list[str]) -> list[bool]:
        now = time.monotonic()
        return [self._lru.contains(fk, now) for fk in full_keys]

    async def delete(self, full_keys: list[str]) -> int:
        found = [fk for fk in dict.fromkeys(full_keys) if self._lru.pop(fk)]
        for fk in found:
            self._notify(fk)
        return len(found)

    async def claim(
        self, full_key: str, ttl_s: float, token: str, give_up_at: float | None = None
    ) -> bool:
        """Claim the key for ``ttl_s`` on behalf of ``token``; never once the caller has given
        up waiting for the answer (``give_up_at``, a ``time.time()`` on this node)."""
        now = time.monotonic()
        if give_up_at is not None and time.time() >= give_up_at:
            return False
        if self._live_claim(full_key, now) is not None:
            return False
        self._claims[full_key] = _Claim(now + ttl_s, token)
        return True

    async def release(self, full_key: str, token: str) -> bool:
        claim = self._claims.get(full_key)
        if claim is None or claim.token != token:
            return False
        del self._claims[full_key]
        self._notify(full_key)
        return True

    async def release_all(self, token: str) -> int:
        mine = [fk for fk, c in self._claims.items() if c.token == token]
        for fk in mine:
            del self._claims[fk]
            self._notify(fk)
        return len(mine)

    async def claimed(self, full_key: str) -> bool:
        return self._live_claim(full_key, time.monotonic()) is not None

    async def wait_for(self, full_key: str, timeout_s: float) -> bool:
        """True once the key is present; False when ``timeout_s`` passes or the claim on it is
        gone (released or expired) without a value."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if self._lru.contains(full_key, now):
                return True
            claim = self._live_claim(full_key, now)
            if claim is None or now >= deadline:
                return False
            wake = self._wakes.get(full_key)
            if wake is None:
                wake = self._wakes[full_key] = _Wake()
            wake.waiters += 1
            try:
                await asyncio.wait_for(wake.event.wait(), min(deadline, claim.deadline) - now)
            except asyncio.TimeoutError:
                pass
            finally:
                wake.waiters -= 1
                if not wake.waiters and self._wakes.get(full_key) is wake:
                    del self._wakes[full_key]

    async def stats(self) -> dict[str, int]:
        return self._lru.stats()


@functools.cache
def node_store_actor_class() -> Any:
    """:class:`NodeStoreActor` as a Ray actor class (made on first use: Ray loads lazily)."""
    import ray

    return ray.remote(NodeStoreActor)


# -- the client --------------------------------------------------------------------------------
def _ensure_ray(store: str, timeout_s: float) -> Any:
    """The ``ray`` module, connected: joins a running cluster when this process is not yet.

    ``ray.init`` waits a long time for a cluster address that does not answer, so the address
    is first probed with a TCP connect bounded by ``timeout_s``.
    """
    import ray

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


class NodeStore(EmbeddingStore):
    """A client of this node's store actor; see the module docstring for the contract.

    ``actor_name`` defaults to the node's actor; give a private one to get an isolated store
    (it is created on this node if it does not exist). ``timeout_s`` bounds every actor call.
    """

    kind = "node"
    verify_payload = True  # values are shared by every process on the node

    def __init__(
        self,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        actor_name: str | None = None,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        super().__init__(namespace=namespace, fingerprint=fingerprint, ttl_s=ttl_s)
        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        ray = _ensure_ray(f"{self.kind}({actor_name or 'default'})", self.timeout_s)
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.actor_name = actor_name or default_actor_name(self.node_id)
        self.actor_namespace = RAY_NAMESPACE
        self._requested_max_bytes = int(max_bytes)
        self._token = uuid.uuid4().hex  # names this object's claims
        self._handle: Any = None
        self._handle_lock = threading.Lock()

        info = self._call("configure", lambda a: a.configure.remote(self._requested_max_bytes))
        self.max_bytes: int = info["max_bytes"]
        self.actor_node_id: str = info["node_id"]
        self.actor_pid: int = info["pid"]
        if info["previous_max_bytes"] != info["max_bytes"]:
            logger.warning(
                "store actor %s: byte budget changed from %d to %d by this opener",
                self.actor_name, info["previous_max_bytes"], info["max_bytes"],
            )  # fmt: skip
        if self.actor_node_id != self.node_id:
            logger.warning(
                "store actor %s runs on node %s, not this node %s: reads will copy",
                self.actor_name, self.actor_node_id, self.node_id,
            )  # fmt: skip

    def __repr__(self) -> str:
        return f"NodeStore(actor={self.actor_name!r}, namespace={self.namespace!r})"

    # -- the actor -----------------------------------------------------------------------------
    @property
    def _label(self) -> str:
        return f"{self.kind}({self.actor_name})"

    def _actor(self) -> Any:
        """The handle of the store actor, found by name or created on this node."""
        with self._handle_lock:
            if self._handle is None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                try:
                    self._handle = (
                        node_store_actor_class()
                        .options(
                            name=self.actor_name,
                            namespace=RAY_NAMESPACE,
                            get_if_exists=True,
                            lifetime="detached",
                            num_cpus=0,
                            max_concurrency=ACTOR_MAX_CONCURRENCY,
                            max_restarts=-1,  # a crashed actor comes back (empty)
                            max_task_retries=0,
                            scheduling_strategy=NodeAffinitySchedulingStrategy(
                                self.node_id, soft=False
                            ),
                        )
                        .remote(self._requested_max_bytes)
                    )
                except Exception as exc:  # the GCS unreachable, Ray shut down, ...
                    self._count("errors")
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

    def _wait(self, what: str, submit: Callable[[], Any], timeout: float | None,
              handle: Any = None) -> Any:  # fmt: skip
        import ray
        from ray import exceptions as rex

        limit = self.timeout_s if timeout is None else timeout
        try:
            return ray.get(submit(), timeout=limit)
        except rex.GetTimeoutError:
            self._count("errors")
            raise StoreUnavailableError(
                self._label, f"{what} timed out after {limit:g} s"
            ) from None
        except (rex.RayActorError, rex.ObjectLostError, rex.RaySystemError) as exc:
            # The actor died or is restarting, or the objects it owned went with it: the next
            # call looks the actor up again (re-creating it, empty, if it is gone).
            self._count("errors")
            self._forget_actor(handle if handle is not None else self._handle)
            reason = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            raise StoreUnavailableError(self._label, reason) from None

    def _fetch(self, refs: list[Any]) -> list[np.ndarray]:
        """The values of ``refs``: read-only arrays mapping the object store (no copy)."""
        return self._wait("fetch", lambda: refs, None) if refs else []

    # -- backend -------------------------------------------------------------------------------
    def _put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
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
        pending = [handle.put.remote(batch, ttl_s) for batch in batches if batch]
        self._wait("put", lambda: pending, None, handle)

    def _get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        refs = self._call("get_refs", lambda a: a.get_refs.remote(full_keys))
        values = iter(self._fetch([r for r in refs if r is not None]))
        return [next(values) if r is not None else None for r in refs]

    def _exists(self, full_keys: list[str]) -> list[bool]:
        return self._call("exists", lambda a: a.exists.remote(full_keys))

    def _get_head(self, full_key: str) -> Buffer | None:
        return self._get_values([full_key])[0]  # the whole value, zero-copy: get_rows slices it

    def _get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        return self._get_values(full_keys)  # one actor call for all (was one per key)

    def _delete(self, full_keys: list[str]) -> int:
        return self._call("delete", lambda a: a.delete.remote(full_keys))

    def _claim(self, full_key: str, ttl_s: float) -> bool:
        handle = self._actor()
        # A claim that timed out here must not be granted later (it would block every waiter
        # until its ttl): the actor refuses it once we have given up (clocks of one node agree),
        # and should it have been granted just before, our release follows it.
        same_node = self.actor_node_id == self.node_id
        give_up_at = time.time() + self.timeout_s if same_node else None
        submit = lambda: handle.claim.remote(full_key, ttl_s, self._token, give_up_at)  # noqa: E731
        try:
            return self._wait("claim", submit, None, handle)
        except StoreUnavailableError:
            with contextlib.suppress(Exception):
                handle.release.remote(full_key, self._token)
            raise

    def _release(self, full_key: str) -> None:
        self._call("release", lambda a: a.release.remote(full_key, self._token))

    def _claimed(self, full_key: str) -> bool:
        return self._call("claimed", lambda a: a.claimed.remote(full_key))

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """As the base contract, in one actor call that is woken by the key's put, release or
        delete (no polling)."""
        fk = self.full_key(key)
        timeout_s = max(0.0, float(timeout_s))
        return self._call("wait_for", lambda a: a.wait_for.remote(fk, timeout_s),
                          timeout=timeout_s + self.timeout_s)  # fmt: skip

    def _backend_stats(self) -> dict[str, int]:
        """The actor's counters: node-wide, since the actor started."""
        return self._call("stats", lambda a: a.stats.remote())

    def close(self) -> None:
        """Give up this object's claims (best effort) and drop the actor handle; the actor and
        its entries stay."""
        if self._handle is not None:
            with contextlib.suppress(StoreUnavailableError):
                self._call("release_all", lambda a: a.release_all.remote(self._token))
        self._forget_actor(self._handle)

    def kill_actor(self) -> None:
        """Kill the store actor: every entry it holds is gone, for every process on the node
        (tests and operators; the next call re-creates it, empty)."""
        import ray

        handle = self._actor()
        ray.kill(handle, no_restart=True)
        self._forget_actor(handle)
