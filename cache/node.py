"""The node-local connection: one Ray actor per node owns the values; readers map them zero-copy.

Every process on a node (encoder replicas, LLM-side readers) opens a :class:`NodeConnection`
(directly, or as the connection of a :class:`NodeStore`, a store over one of its own); they all
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
* **Checked once, when put.** The actor checks each value in full (key, format, payload
  checksum) before it stores it and refuses a bad one (counted in ``rejected``); a stored
  object is sealed and mapped read-only by every reader, so its bytes cannot change, and reads
  check the header only (key, fingerprint), never the payload again. A value of a newer format
  version is stored unchecked (newer readers want it; older ones read it as a miss).
* **Lookups read no value.** The actor keeps each entry's header bytes (a few hundred bytes)
  beside its ObjectRef, so ``headers_many`` and ``lookup_or_claim`` are one actor call that
  moves headers only.
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
* **Budget, LRU, TTL** exactly as :mod:`vitserve.cache.memory`, but node-wide: the bytes held
  never exceed ``max_bytes`` after a put returns (least recently used entries go first; a value
  larger than the budget is refused and counted in ``too_large``); an expired entry is never
  returned. The budget is the actor's: whoever opens a store with another ``max_bytes`` resizes
  it (with a warning). Keep ``max_bytes`` plus the readers' ``read_cache_bytes`` well below the
  node's object store memory, or Ray spills entries to disk (still correct, no longer
  zero-copy).
* **Claims** live in the actor: full key -> (deadline, token); the token is per ``NodeConnection``
  object, so only the claimant's ``release`` counts; a claim whose caller timed out is never
  granted behind its back. ``wait_for`` is one actor call that sleeps on a
  ``threading.Event`` per key, woken by the put / release / delete of that key. ``put``
  releases the claims it is given after indexing the values, in the same call.
* **A threaded actor.** Every method is synchronous and holds one lock only while it touches
  the index; ``wait_for`` runs in its own concurrency group, so sleeping waiters never hold up
  lookups. Chosen by measurement on a 2-vCPU AMD EPYC (``loadtest/results/stores-cpu.md``): a
  one-key ``lookup_or_claim`` took 1.00-1.16 ms p50 on the async actor this replaced and
  0.80-0.83 ms on this one (an async actor's call takes an extra hop through its event loop).
* **Timeouts.** Every actor call and object fetch is bounded by ``timeout_s`` (``wait_for``: its
  own timeout plus ``timeout_s``); a timeout, a dead or restarting actor, or a lost object raises
  :class:`~vitserve.errors.StoreUnavailableError` (retryable) and counts in ``errors``. After the
  actor died, the next call finds or re-creates it by name (empty), so a store heals itself.

Ray is imported lazily (here only inside functions), so ``import vitserve.cache`` stays light.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray import exceptions as rex
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.codec import decode_record, header_bytes_needed
from vitserve.cache.connection import Buffer, Connection, buffer_nbytes
from vitserve.cache.lru import ByteBudgetLru
from vitserve.errors import ConfigError, RecordFormatError, StoreUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30
#: what each reader keeps of the values it read (see the module docstring)
DEFAULT_READ_CACHE_BYTES = 256 << 20
DEFAULT_READ_CACHE_S = 5.0
#: the Ray namespace of every store actor (independent of the caller's job namespace)
RAY_NAMESPACE = "vitserve"
ACTOR_NAME_PREFIX = "vitserve-node-store-"
#: threads of the store actor for lookups, claims, reads and puts (each call holds its lock
#: only to touch the index; a put checks and copies its values outside it)
ACTOR_THREADS = 8
#: threads for ``wait_for`` calls, which sleep until their key is published: more waiters than
#: this at once queue for a thread (a queued wait may then time out on the caller's side, and
#: the caller encodes the image itself, as after any failed wait)
WAIT_THREADS = 128
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


@dataclass(slots=True)
class _Held:
    """One entry: the object the actor owns, its header bytes, and when it expires."""

    ref: Any
    head: bytes
    expires: float | None


def _checked(full_key: str, value: np.ndarray) -> bytes | None:
    """The value's header bytes if it is a valid record of its key (or of a newer format
    version, which this code cannot check); None if it must be refused."""
    key = full_key.rpartition("/")[2]
    try:
        decode_record(value, key=key, verify=True)
    except RecordFormatError as exc:
        if not exc.newer_version:
            return None
    try:
        return bytes(value[: header_bytes_needed(value)])
    except RecordFormatError:
        return None


class _Wake:
    """Wakes everyone waiting on one key."""

    __slots__ = ("event", "waiters")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.waiters = 0


class NodeStoreActor:
    """The per-node index and owner of the values (a threaded Ray actor; wrap with
    :func:`node_store_actor_class`). Its state is touched only under ``self._lock``; the only
    slow step, copying values into owned objects, runs outside it. ``wait_for`` runs in its own
    concurrency group (``WAIT_THREADS``), so waiters never hold up lookups and puts."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, share_bytes: int | None = None) -> None:
        self._ray = ray
        self._lock = threading.Lock()
        # full key -> _Held (an object this actor owns)
        self._lru = ByteBudgetLru(max_bytes, share_bytes)
        self._claims: dict[str, _Claim] = {}
        self._wakes: dict[str, _Wake] = {}
        self._node_id = ray.get_runtime_context().get_node_id()
        self._rejected = 0  # values refused by the check at put

    # -- helpers (the caller holds the lock) -----------------------------------------------------
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

    def _claim(self, fk: str, ttl_s: float, token: str, give_up_at: float | None) -> bool:
        now = time.monotonic()
        if give_up_at is not None and time.time() >= give_up_at:
            return False
        if self._live_claim(fk, now) is not None:
            return False
        self._claims[fk] = _Claim(now + ttl_s, token)
        return True

    def _release(self, fk: str, token: str) -> bool:
        claim = self._claims.get(fk)
        if claim is None or claim.token != token:
            return False
        del self._claims[fk]
        self._notify(fk)
        return True

    # -- methods -------------------------------------------------------------------------------
    def configure(self, max_bytes: int, share_bytes: int | None = None) -> dict[str, Any]:
        """Set the byte budget (evicting to fit) and each namespace's share, and describe the
        actor."""
        with self._lock:
            previous = self._lru.max_bytes, self._lru.share_bytes
            self._lru.resize(max_bytes)  # evicts to fit a smaller budget
            self._lru.set_share(share_bytes)
            return {
                "max_bytes": self._lru.max_bytes,
                "previous_max_bytes": previous[0],
                "share_bytes": self._lru.share_bytes,
                "previous_share_bytes": previous[1],
                "node_id": self._node_id,
                "pid": os.getpid(),
            }

    def put(
        self,
        items: list[tuple[str, np.ndarray]],
        ttl_s: float | None,
        releases: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Check each value, copy the good ones into objects this actor owns and index them
        (replacing any); then release the claims ``releases`` names as (full key, token)."""
        try:
            budget = self._lru.max_bytes
            owned: list[tuple[Any, bytes] | None] = []
            for fk, value in items:  # outside the lock: the check and the copy take time
                head = _checked(fk, value)
                if head is None:
                    owned.append(None)
                elif value.nbytes > budget:  # refused by the LRU below (too_large)
                    owned.append((None, head))
                else:  # Ray owns what the actor puts: this copy outlives the writer
                    owned.append((self._ray.put(value), head))
            with self._lock:
                self._rejected += sum(held is None for held in owned)
                now = time.monotonic()
                expires = now + ttl_s if ttl_s is not None else None
                for (fk, value), held in zip(items, owned, strict=True):
                    if held is not None:
                        self._lru.put(
                            fk, _Held(held[0], held[1], expires), int(value.nbytes), expires
                        )
                        self._notify(fk)
        finally:
            with self._lock:
                for fk, token in releases:
                    self._release(fk, token)

    def get_refs(self, full_keys: list[str]) -> list[tuple[Any, float | None] | None]:
        """Per key (ObjectRef, seconds until it expires or None), nested so the caller borrows
        the ref; None where missing. Marks them recently used."""
        out: list[tuple[Any, float | None] | None] = []
        with self._lock:
            now = time.monotonic()
            for fk in full_keys:
                held = self._lru.get(fk, now)
                if held is None:
                    out.append(None)
                else:
                    out.append((held.ref, None if held.expires is None else held.expires - now))
        return out

    def heads(self, full_keys: list[str]) -> list[bytes | None]:
        """The header bytes of each key's value (None where missing); marks them used."""
        with self._lock:
            now = time.monotonic()
            return [None if (h := self._lru.get(fk, now)) is None else h.head for fk in full_keys]

    def lookup_or_claim(
        self, full_keys: list[str], ttl_s: float, token: str, give_up_at: float | None = None
    ) -> list[bytes | bool]:
        """Per key its header bytes (marking it used), else the outcome of ``claim``."""
        with self._lock:
            now = time.monotonic()
            out: list[bytes | bool] = []
            for fk in full_keys:
                held = self._lru.get(fk, now)
                out.append(
                    held.head if held is not None else self._claim(fk, ttl_s, token, give_up_at)
                )
            return out

    def states(self, full_keys: list[str]) -> list[bytes | bool]:
        """Per key its header bytes (marking it used), else whether a live claim holds it."""
        with self._lock:
            now = time.monotonic()
            return [
                held.head
                if (held := self._lru.get(fk, now)) is not None
                else self._live_claim(fk, now) is not None
                for fk in full_keys
            ]

    def exists(self, full_keys: list[str]) -> list[bool]:
        with self._lock:
            now = time.monotonic()
            return [self._lru.contains(fk, now) for fk in full_keys]

    def delete(self, full_keys: list[str]) -> int:
        with self._lock:
            found = [fk for fk in dict.fromkeys(full_keys) if self._lru.pop(fk)]
            for fk in found:
                self._notify(fk)
            return len(found)

    def claim(
        self, full_key: str, ttl_s: float, token: str, give_up_at: float | None = None
    ) -> bool:
        """Claim the key for ``ttl_s`` on behalf of ``token``; never once the caller has given
        up waiting for the answer (``give_up_at``, a ``time.time()`` on this node)."""
        with self._lock:
            return self._claim(full_key, ttl_s, token, give_up_at)

    def release(self, full_key: str, token: str) -> bool:
        with self._lock:
            return self._release(full_key, token)

    def release_all(self, token: str) -> int:
        with self._lock:
            mine = [fk for fk, c in self._claims.items() if c.token == token]
            return sum(self._release(fk, token) for fk in mine)

    def claimed(self, full_key: str) -> bool:
        with self._lock:
            return self._live_claim(full_key, time.monotonic()) is not None

    def wait_for(self, full_key: str, timeout_s: float) -> bool:
        """True once the key is present; False when ``timeout_s`` passes or the claim on it is
        gone (released or expired) without a value. Runs in the ``waits`` group."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
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
                wake.event.wait(min(deadline, claim.deadline) - now)
            finally:
                with self._lock:
                    wake.waiters -= 1
                    if not wake.waiters and self._wakes.get(full_key) is wake:
                        del self._wakes[full_key]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._lru.stats(), "rejected": self._rejected}


@functools.cache
def node_store_actor_class() -> Any:
    """:class:`NodeStoreActor` as a threaded Ray actor class, ``wait_for`` in its own
    concurrency group (made on first use)."""

    class VitserveNodeStore(NodeStoreActor):
        @ray.method(concurrency_group="waits")
        def wait_for(self, full_key: str, timeout_s: float) -> bool:
            return super().wait_for(full_key, timeout_s)

    return ray.remote(concurrency_groups={"waits": WAIT_THREADS})(VitserveNodeStore)


# -- the client --------------------------------------------------------------------------------
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
