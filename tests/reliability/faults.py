"""Helpers of the fault tests (``test_faults.py``): a client load that keeps every answer, the
check of answers against the in-process engine, Serve replicas by name, and Redis corruption.

Nothing here injects a fault by itself; the tests decide when and what.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from vitserve.client.core import RetryPolicy
from vitserve.testing.images import make_image

_seeds = itertools.count(7_000_000)  # images no other test module sends


def fresh_image(size: tuple[int, int] = (64, 48)) -> bytes:
    """A small PNG no earlier call returned (a new seed each call)."""
    return make_image(*size, seed=next(_seeds))


@dataclass(frozen=True)
class CountedRetries(RetryPolicy):
    """The SDK's default retry policy, counting the retries it grants (a fault that reached
    a request in flight shows here)."""

    granted: list[int] = field(default_factory=lambda: [0], compare=False)

    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        with self._lock:  # the load's threads share the policy
            self.granted[0] += 1
        return RetryPolicy.delay(self, attempt, retry_after)


@dataclass(frozen=True)
class Answer:
    """One encode-then-fetch through the SDK that succeeded."""

    key: str
    image: bytes
    started: float  # time.monotonic() when the encode was sent
    cached: bool  # the service held the embedding before this encode
    embedding: np.ndarray  # a copy of the fetched rows


@dataclass
class Load:
    """Client threads, each with its own ``EncoderClient`` (default retries, counted), each doing
    encode-then-fetch of one image back to back until stopped: a new image every other time,
    else one of ``repeats`` (the same few images again and again). Every answer and failure is
    kept; ``tried`` counts the operations started, ``retries`` the retries the SDK made."""

    url: str
    threads: int = 3
    repeats: list[bytes] = field(default_factory=lambda: [fresh_image() for _ in range(3)])
    answers: list[Answer] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    tried: int = 0
    retry: CountedRetries = field(default_factory=CountedRetries)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    #: Every load started and not yet stopped: ``stop_all`` (test_faults' autouse fixture)
    #: stops what a failed test left running, so its clients never load the tests after it.
    running: ClassVar[list[Load]] = []

    def start(self) -> Load:
        Load.running.append(self)
        for n in range(self.threads):
            worker = threading.Thread(target=self._run, args=(n,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def _run(self, n: int) -> None:
        from vitserve.client import EncoderClient

        with EncoderClient(self.url, timeout_s=60, retry=self.retry) as client:
            for i in itertools.count():
                if self._stop.is_set():
                    return
                image = fresh_image() if i % 2 == 0 else self.repeats[(i // 2 + n) % 3]
                with self._lock:
                    self.tried += 1
                started = time.monotonic()
                try:
                    [handle] = client.encode([image])
                    [record] = client.fetch([handle])
                    answer = Answer(
                        handle.key, image, started, handle.cached, np.array(record.embedding)
                    )
                except Exception as exc:  # every failure is counted, whatever its class
                    with self._lock:
                        self.failures.append(f"{type(exc).__name__}: {exc}"[:300])
                    continue
                with self._lock:
                    self.answers.append(answer)

    @property
    def retries(self) -> int:
        return self.retry.granted[0]

    def answered_since(self, t: float, *, new: bool = False) -> int:
        """Answers to operations started at ``t`` or later (``new``: of images the service
        did not hold)."""
        with self._lock:
            return sum(1 for a in self.answers if a.started >= t and not (new and a.cached))

    def repeats_answered(self) -> bool:
        """Whether each of the repeated images has been answered once."""
        with self._lock:
            seen = {a.image for a in self.answers}
        return all(r in seen for r in self.repeats)

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self, timeout_s: float = 60) -> int:
        """Stop the threads; how many are still running after ``timeout_s`` (their requests
        were never answered: lost)."""
        self._stop.set()
        if self in Load.running:
            Load.running.remove(self)
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        return sum(w.is_alive() for w in self._workers)

    @classmethod
    def stop_all(cls) -> None:
        for load in list(cls.running):
            load.stop()


def check_answers(answers: list[Answer], engine: Any) -> tuple[list[str], list[str]]:
    """``(wrong, differing)``: answers whose embedding is not the in-process engine's on the
    same image encoded alone (within the engine's batching tolerance), each as ``key: how
    far`` (ulps, or the shapes); and the keys whose answers are not bit-equal to that key's
    first answer."""
    import torch

    from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart

    images = {a.key: a.image for a in answers}
    # each image alone: what the engine's batching promise is stated against (two batches of
    # other compositions may each be that far from it, in opposite directions)
    reference = {key: engine.encode([image])[0] for key, image in images.items()}
    first: dict[str, np.ndarray] = {}
    wrong, differing = [], []
    for a in answers:
        want = reference[a.key].tensor
        got = torch.from_numpy(a.embedding)
        if got.shape != want.shape:
            wrong.append(f"{a.key}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
        elif (apart := ulps_apart(got, want)) > BATCH_TOLERANCE_ULPS["fp32"]:
            wrong.append(f"{a.key}: {apart:.1f} ulps (cached {a.cached})")
        if not np.array_equal(first.setdefault(a.key, a.embedding), a.embedding):
            differing.append(a.key)
    return wrong, differing


def replicas(app_name: str, deployment: str) -> list[tuple[str, Any]]:
    """``(actor name, handle)`` of each live replica of ``deployment`` in ``app_name``."""
    import ray

    named = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if f"{app_name}#{deployment}#" in a["name"]
    ]
    live = []
    for a in named:
        try:
            live.append((a["name"], ray.get_actor(a["name"], namespace=a["namespace"])))
        except ValueError:  # it died between the listing and the lookup: not live
            continue
    return live


def kill_while_busy(actor: Any, timeout_s: float = 30) -> bool:
    """``ray.kill`` the replica actor as soon as it has a request in flight (Serve's replica
    counter, polled every 10 ms); False if it never had one within ``timeout_s`` (then it is
    killed anyway)."""
    import ray

    deadline = time.monotonic() + timeout_s
    busy = False
    while not busy and time.monotonic() < deadline:
        busy = ray.get(actor.get_num_ongoing_requests.remote(), timeout=5) > 0
        if not busy:
            time.sleep(0.01)
    ray.kill(actor, no_restart=True)  # Serve's controller starts another
    return busy


def wait_for_replacement(app_name: str, deployment: str, killed: str, timeout_s: float) -> bool:
    """Whether a replica other than ``killed`` is up within ``timeout_s`` (Serve restarted it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(name != killed for name, _ in replicas(app_name, deployment)):
            return True
        time.sleep(0.2)
    return False


# -- corrupting a Redis store's values ------------------------------------------------------------
def redis_value_key(namespace: str, key: str, prefix: str = "vsm") -> str:
    """Where a RedisStore keeps ``key``'s value (see vitserve.cache.redis_store)."""
    return f"{prefix}:v:{namespace}/{key}" if namespace else f"{prefix}:v:{key}"


def landed_value(client: Any, name: str, timeout_s: float = 10.0) -> bytes:
    """The value at ``name`` once it is there: the encoder answers as soon as its publish is
    handed off to its publish thread, so the value may land a moment after the answer. (The
    corruptions below read the value as it is: call this first.)"""
    deadline = time.monotonic() + timeout_s
    while (value := client.get(name)) is None:
        assert time.monotonic() < deadline, f"{name} never landed"
        time.sleep(0.01)
    return bytes(value)


def landed_keys(store: Any, keys: list[str], timeout_s: float = 10.0) -> list[bool]:
    """``store.exists_many(keys)`` once every key is there, or as it stands at ``timeout_s``:
    as :func:`landed_value`, a key's value may land a moment after its encode's answer."""
    deadline = time.monotonic() + timeout_s
    while not all(found := store.exists_many(keys)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def flip_payload_byte(client: Any, name: str) -> None:
    """Flip one byte inside the payload (SETRANGE): the header still reads as valid."""
    from vitserve.cache.codec import read_header

    value = client.get(name)
    at = read_header(value).payload_offset + 5
    client.setrange(name, at, bytes([value[at] ^ 0xFF]))


def truncate(client: Any, name: str) -> None:
    """Cut the value in the middle of its payload (its header intact)."""
    from vitserve.cache.codec import read_header

    value = client.get(name)
    offset = read_header(value).payload_offset
    client.set(name, value[: offset + (len(value) - offset) // 2])


def other_fingerprint(client: Any, name: str) -> None:
    """Replace the value by a well-formed record of the same key and rows made by another
    model (another fingerprint in its header)."""
    from dataclasses import replace

    from vitserve.cache.codec import decode_record, encode_record

    record = decode_record(client.get(name))
    client.set(name, bytes(encode_record(replace(record, fingerprint="0" * 64))))


CORRUPTIONS: dict[str, Callable[[Any, str], None]] = {
    "payload byte flipped": flip_payload_byte,
    "value truncated": truncate,
    "header of another fingerprint": other_fingerprint,
}
