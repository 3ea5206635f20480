"""What is specific to the node-local store, on a real Ray cluster: entries outlive their
publisher, reads copy nothing, one node-wide budget across processes, and an unreachable actor
fails fast. (Round trips, TTL, LRU, claims and namespaces: tests/cache/test_conformance.py.)"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from vitserve.cache.codec import encode_record
from vitserve.cache.node import RAY_NAMESPACE, NodeStore, default_actor_name
from vitserve.errors import StoreUnavailableError
from vitserve.testing.records import make_record


@pytest.fixture
def actor_name(ray_cluster) -> Iterator[Callable[[], str]]:
    """Makes private store-actor names; kills those actors at teardown."""
    names: list[str] = []

    def make() -> str:
        names.append(f"vitserve-test-nodestore-{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield make
    for name in names:
        with contextlib.suppress(ValueError):
            ray_cluster.kill(ray_cluster.get_actor(name, namespace=RAY_NAMESPACE))


def _assert_same(got, want) -> None:
    assert got is not None and got.key == want.key
    for name, array in want.tensors.items():
        assert np.array_equal(got.tensors[name], array)


def _kill_and_wait(ray, handle, probe: str) -> None:
    """ray.kill the actor, and return once calls to it fail (ray.kill is asynchronous)."""
    ray.kill(handle)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            ray.get(getattr(handle, probe).remote(), timeout=10)
            time.sleep(0.05)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError("the actor did not die")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Publisher:
    """Stand-in for an encoder replica: publishes through its own NodeStore."""

    def __init__(self, actor_name: str) -> None:
        self.store = NodeStore(actor_name=actor_name)

    def publish(self, records) -> list:
        """Puts ``records``; returns, nested, a ref to a copy of the first value that this
        process ``ray.put`` itself (so this process owns it)."""
        import ray

        self.store.put_many(records)
        own = ray.put(np.frombuffer(encode_record(records[0]), dtype=np.uint8))
        return [own]

    def pid(self) -> int:
        return os.getpid()


def test_entries_survive_the_death_of_their_publisher(ray_cluster, actor_name) -> None:
    ray = ray_cluster
    name = actor_name()
    records = [make_record(rows=300, width=256, seed=i, extras=i) for i in range(3)]
    publisher = ray.remote(num_cpus=0)(Publisher).remote(name)
    pid = ray.get(publisher.pid.remote(), timeout=30)
    [own_ref] = ray.get(publisher.publish.remote(records), timeout=30)
    assert np.array_equal(ray.get(own_ref, timeout=10), encode_record(records[0]))

    _kill_and_wait(ray, publisher, "pid")
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the publisher's process is gone"
    died = time.monotonic()

    # What the publisher put itself died with it (once Ray has noticed the owner's death) ...
    lost = None
    while lost is None and time.monotonic() < deadline:
        try:
            ray.get(own_ref, timeout=10)
            time.sleep(0.1)
        except ray.exceptions.ObjectLostError as exc:
            lost = exc
    assert isinstance(lost, ray.exceptions.OwnerDiedError), "the publisher's own object is lost"
    print(f"the publisher's own object was lost {time.monotonic() - died:.2f} s after its death")
    # ... what it published through the store actor did not: the actor owns those objects.
    reader = NodeStore(actor_name=name)
    conn = reader.connection
    assert conn.actor_pid != pid and conn.actor_node_id == conn.node_id
    for got, want in zip(reader.get_many([r.key for r in records]), records, strict=True):
        _assert_same(got, want)
    assert reader.stats()["entries"] == 3


def _owner_chain(array: np.ndarray) -> list[object]:
    chain: list[object] = [array]
    while isinstance(chain[-1], np.ndarray) and chain[-1].base is not None:
        chain.append(chain[-1].base)
    return chain


def _peak_allocation(fn: Callable[[], object]) -> tuple[int, object]:
    """The peak of Python (and numpy) heap allocation while ``fn`` runs, and its result."""
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before, result


def test_reads_are_zero_copy_views_of_the_object_store(ray_cluster, actor_name) -> None:
    store = NodeStore(actor_name=actor_name())
    record = make_record(rows=8192, width=1024, seed=7)  # 32 MiB of fp32
    tiny = make_record(rows=2, width=8, seed=8)
    payload = record.nbytes
    assert payload == 32 * 2**20
    store.put_many([record, tiny])
    store.get_many([record.key, tiny.key])  # warm up: imports, first mapping of the store

    allocated, got = _peak_allocation(lambda: store.get(record.key))
    fixed, _ = _peak_allocation(lambda: store.get(tiny.key))
    print(
        f"\nget of a {payload >> 20} MiB record: peak allocation {allocated} bytes "
        f"(of a {tiny.nbytes}-byte record: {fixed})"
    )
    # Ray's ray.get has a fixed transient (~1 MiB here, whatever the size); what grows with the
    # payload would be a copy: there is none.
    assert allocated - fixed < payload // 1000
    assert allocated < payload // 16

    _assert_same(got, record)
    emb = got.embedding
    assert not emb.flags.writeable and not emb.flags.owndata
    chain = _owner_chain(emb)
    assert all(not a.flags.owndata for a in chain if isinstance(a, np.ndarray))
    assert not isinstance(chain[-1], np.ndarray)  # the buffer is Ray's object-store mapping
    assert type(chain[-1]).__module__.startswith("ray")
    # every read maps the same shared bytes: nothing is copied per read, rows included
    again = store.get(record.key)
    assert np.shares_memory(emb, again.embedding)
    part = store.get_rows(record.key, 4000, 4100)
    assert np.shares_memory(part.embedding, emb)
    np.testing.assert_array_equal(part.embedding, record.embedding[4000:4100])


def test_a_reader_keeps_its_arrays_after_the_entry_is_gone(ray_cluster, actor_name) -> None:
    store = NodeStore(actor_name=actor_name(), max_bytes=20 * 2**20)
    record = make_record(rows=2048, width=1024, seed=1)  # 8 MiB
    store.put_many([record])
    got = store.get(record.key)
    assert store.delete(record.key) == 1
    # churn: same-sized objects that would reuse the freed memory if Ray had freed it
    for seed in range(2, 8):
        store.put_many([make_record(rows=2048, width=1024, seed=seed)])
    gc.collect()
    assert store.stats()["evictions"] >= 4
    _assert_same(got, record)


def test_sleeping_waiters_do_not_hold_up_lookups_and_a_put_wakes_them_all(
    ray_cluster, actor_name
) -> None:
    """More waiters than the actor has threads for its other calls: they sleep in their own
    group, so lookups, claims and the put still answer at once, and the put wakes every one."""
    from concurrent.futures import ThreadPoolExecutor

    from vitserve.cache.node_actor import ACTOR_THREADS, WAIT_THREADS

    name = actor_name()
    owner, waiter = NodeStore(actor_name=name), NodeStore(actor_name=name)
    record = make_record(rows=4, width=8, seed=3)
    assert owner.claim(record.key, ttl_s=60)
    waiters = ACTOR_THREADS * 2
    assert waiters <= WAIT_THREADS
    with ThreadPoolExecutor(waiters) as pool:
        waits = [pool.submit(waiter.wait_for, record.key, 60) for _ in range(waiters)]
        time.sleep(1.0)  # the waits reach the actor and sleep there
        assert not any(w.done() for w in waits)
        start = time.monotonic()
        assert waiter.headers_many([record.key]) == [None]
        assert waiter.claim("another-key", ttl_s=5)
        owner.put_values([(record.key, encode_record(record))], release=[(record.key, owner.token)])
        assert time.monotonic() - start < 5  # not after the waits' 60 s
        assert [w.result(timeout=10) for w in waits] == [True] * waiters
    assert time.monotonic() - start < 10


@pytest.fixture
def remote_open(ray_cluster):
    """Runs NodeStore calls in another process (a Ray task, as a second replica would)."""

    @ray_cluster.remote(num_cpus=0)
    def run(actor_name: str, max_bytes: int, put=(), check=()) -> dict:
        store = NodeStore(actor_name=actor_name, max_bytes=max_bytes)
        seen = store.get_many([r.key for r in check])
        same = [
            g is not None and np.array_equal(g.embedding, r.embedding)
            for g, r in zip(seen, check, strict=True)
        ]
        store.put_many(list(put))
        return {"pid": os.getpid(), "same": same, "stats": store.stats()}

    return lambda *args, **kw: ray_cluster.get(run.remote(*args, **kw), timeout=60)


def test_processes_share_entries_and_one_node_wide_budget(actor_name, remote_open) -> None:
    a, b, c, d = (make_record(rows=256, width=256, seed=i) for i in range(4))
    size = len(encode_record(a))
    budget = size * 7 // 2  # room for three values
    name = actor_name()
    here = NodeStore(actor_name=name, max_bytes=budget)
    here.put_many([a])
    # another process reads what this one put, then puts two more
    there = remote_open(name, budget, put=[b, c], check=[a])
    assert there["pid"] != os.getpid()
    assert there["same"] == [True]
    for got, want in zip(here.get_many([b.key, c.key]), [b, c], strict=True):
        _assert_same(got, want)
    stats = here.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (3, 3 * size, 0)
    # a fourth value, from this process, overflows the budget both processes put into
    here.put_many([d])
    assert here.exists_many([a.key, b.key, c.key, d.key]) == [False, True, True, True]
    stats = here.stats()
    assert stats["bytes"] == 3 * size <= budget and stats["evictions"] == 1
    after = remote_open(name, budget, check=[b, c, d])
    assert after["same"] == [True, True, True]
    assert after["stats"]["evictions"] == 1  # the other process sees the node-wide counters


def test_default_actor_is_per_node_and_found_by_every_opener(ray_cluster) -> None:
    first, second = NodeStore(namespace="ns-a"), NodeStore(namespace="ns-b")
    a, b = first.connection, second.connection
    assert a.actor_name == default_actor_name(a.node_id) == b.actor_name
    assert a.actor_pid == b.actor_pid
    assert a.actor_node_id == a.node_id


def test_unreachable_actor_fails_fast_then_heals(ray_cluster, actor_name) -> None:
    ray = ray_cluster
    name = actor_name()
    record = make_record(seed=3)
    NodeStore(actor_name=name).put_many([record])
    store = NodeStore(actor_name=name, timeout_s=0.5)

    # A hung actor (its process stopped): every call gives up after timeout_s.
    os.kill(store.connection.actor_pid, signal.SIGSTOP)
    waited = []
    try:
        for call in (
            lambda: store.get(record.key),
            lambda: store.exists_many([record.key]),
            lambda: store.claim(record.key, ttl_s=5),
            store.stats,
        ):
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError) as err:
                call()
            waited.append(time.monotonic() - start)
            assert 0.45 <= waited[-1] < 3 * 0.5, waited  # at its timeout, not a multiple
            assert err.value.retryable and "timed out" in err.value.reason
    finally:
        os.kill(store.connection.actor_pid, signal.SIGCONT)
    assert store.stats()["errors"] == 4
    _assert_same(store.get(record.key), record)  # the actor is back, entries intact
    assert not store.connection.claimed(
        store.full_key(record.key)
    )  # the timed-out claim was undone

    # A dead actor: the next call fails at once; the one after re-creates it (empty).
    _kill_and_wait(ray, ray.get_actor(name, namespace=RAY_NAMESPACE), "stats")
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        store.headers_many([record.key])  # not get: this reader still keeps what it read
    failed_in = time.monotonic() - start
    # at once: sooner than any of the calls above, which each waited out the timeout
    assert failed_in < min(waited), (failed_in, waited)
    assert err.value.retryable and "Actor" in err.value.reason, err.value.reason
    print(
        f"\ncall to a dead store actor failed in {failed_in * 1e3:.0f} ms "
        f"(hung: {min(waited):.2f} s): {err.value.reason}"
    )
    store.connection.timeout_s = 10.0  # re-creating the actor starts a process: more than 0.5 s
    assert store.exists_many([record.key]) == [False]
    assert store.stats()["entries"] == 0
    assert store.stats()["errors"] == 5


_OPEN_WITHOUT_INIT = """
import sys, time
import ray
from vitserve.cache.node import NodeStore
from vitserve.errors import StoreUnavailableError
assert not ray.is_initialized()
start = time.monotonic()
try:
    got = NodeStore(actor_name=sys.argv[1], timeout_s=2).get(sys.argv[2])
    print("got", got is not None and got.embedding.sum().item(), time.monotonic() - start)
except StoreUnavailableError as exc:
    print("unavailable", exc.retryable, time.monotonic() - start)
"""


def test_a_process_without_ray_joins_the_cluster_or_fails_fast(ray_cluster, actor_name) -> None:
    name = actor_name()
    record = make_record(seed=4)
    NodeStore(actor_name=name).put_many([record])

    def run(address: str) -> list[str]:
        env = {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}
        out = subprocess.run(
            [sys.executable, "-c", _OPEN_WITHOUT_INIT, name, record.key],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    joined = run(ray_cluster.get_runtime_context().gcs_address)
    assert joined[:2] == ["got", str(record.embedding.sum().item())]
    refused = run("127.0.0.1:1")  # nothing listens there
    assert refused[:2] == ["unavailable", "True"] and float(refused[2]) < 2.5
