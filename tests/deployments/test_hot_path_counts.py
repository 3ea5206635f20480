"""The hot path's budgets, counted (not timed), so they hold on every machine.

The ingress's per-request flow (:class:`EncodeFlow`) and the real encoder deployment class run
in this process over real stores (the node store on the session's Ray cluster, and Redis), with
a counting wrapper on each store object and a counting stand-in for each Serve handle (it
pickles the arguments, as a Serve call does, and resolves a handle's answer passed to another
call, as Serve does by reference). Budgets (issue 11):

* a new image costs at most two store round trips on its path: the ingress's
  ``lookup_or_claim`` and the encoder's publish (which releases the claim); the encoder makes
  no store call before its forward;
* an all-cached request costs exactly one store round trip and no encoder call;
* a request makes one encoder call whatever its number of new images (two Serve calls when
  preprocessing runs in its own deployment);
* concurrent requests sharing an image encode it once.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from vitserve.testing.images import make_image

pytestmark = pytest.mark.usefixtures("ray_cluster")


class Counts:
    """Calls by name (``store.lookup_or_claim``, ``serve.encoder.encode``...)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def store(self) -> int:
        """Store round trips, less the encoder's once-a-second gauge report (``stats``)."""
        return sum(
            n
            for name, n in self.calls.items()
            if name.startswith("store.") and name != "store.stats"
        )

    def serve(self) -> int:
        return sum(n for name, n in self.calls.items() if name.startswith("serve."))

    def reset(self) -> None:
        self.calls.clear()


class CountingStore:
    """A real store whose public calls (each one backend round trip) are counted."""

    UNCOUNTED = frozenset({"token", "namespace", "fingerprint", "full_key", "kind"})

    def __init__(self, store: Any, counts: Counts) -> None:
        self._store = store
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name in self.UNCOUNTED or not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._counts.calls[f"store.{name}"] += 1
            return attr(*args, **kwargs)

        return counted


class _Method:
    def __init__(self, target: Any, name: str, label: str, counts: Counts) -> None:
        self.fn = getattr(target, name)
        self.label = label
        self.counts = counts

    def remote(self, *args: Any) -> asyncio.Task:
        self.counts.calls[f"serve.{self.label}"] += 1
        payload = pickle.dumps(
            [a if not isinstance(a, asyncio.Task) else None for a in args]
        )  # what Serve would serialize (a handle's answer goes by reference)

        async def call() -> Any:
            copied = pickle.loads(payload)
            resolved = [
                await a if isinstance(a, asyncio.Task) else c
                for a, c in zip(args, copied, strict=True)
            ]
            result = self.fn(*resolved)
            if asyncio.iscoroutine(result):
                result = await result
            return pickle.loads(pickle.dumps(result))

        return asyncio.ensure_future(call())


class CountingHandle:
    """Stands in for a Serve deployment handle: ``handle.method.remote(...)`` is counted."""

    def __init__(self, target: Any, label: str, counts: Counts) -> None:
        self._target, self._label, self._counts = target, label, counts

    def __getattr__(self, name: str) -> _Method:
        return _Method(self._target, name, f"{self._label}.{name}", self._counts)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    for task in asyncio.all_tasks(loop):  # the encoders' queue loops and gauge reporters
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


@pytest.fixture(scope="module", params=["node", "redis"])
def store_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    return "node://" if request.param == "node" else redis_url


@pytest.fixture(scope="module")
def engine_cfg(tiny_models, batching_limits) -> dict[str, Any]:
    return {
        "model": str(tiny_models["qwen2_vl"]),
        "dtype": "fp32",
        "torch_threads": 1,
        "budget_bytes": batching_limits["budget_bytes"],
        "batching.max_batch_patches": batching_limits["max_batch_patches"],
    }


class Service:
    """An ingress flow and an encoder (the real classes), each with its own store object."""

    def __init__(self, loop, cfg: dict[str, Any], store_url: str, preprocess_at: str) -> None:
        from vitserve.cache import open_store
        from vitserve.deployments.common.config import VitserveConfig
        from vitserve.deployments.encoder.encode_flow import EncodeFlow
        from vitserve.deployments.encoder.preprocessing import (
            PreprocessDeployment,
            make_preprocessor,
        )
        from vitserve.deployments.encoder.replica import EncoderDeployment

        self.loop = loop
        self.cfg = VitserveConfig.load(
            {
                **cfg,
                "store": store_url,
                "preprocess_at": preprocess_at,
                "namespace": f"count-{uuid.uuid4().hex[:8]}",
            }
        )
        plain = self.cfg.model_dump()
        self.counts = Counts()
        encoder = EncoderDeployment.func_or_class(plain)
        encoder.store = CountingStore(encoder.store, self.counts)
        self.encoder = encoder
        self.fingerprint = encoder.engine.fingerprint
        preprocess = preprocessor = None
        if preprocess_at == "deployment":
            preprocess = CountingHandle(
                PreprocessDeployment.func_or_class(plain), "preprocess", self.counts
            )
        elif preprocess_at == "ingress":
            preprocessor = make_preprocessor(self.cfg)
        store = open_store(self.cfg.store, namespace=self.cfg.namespace)
        self.flow = EncodeFlow(
            self.cfg,
            CountingStore(store, self.counts),
            CountingHandle(encoder, "encoder", self.counts),
            preprocess,
            preprocessor,
        )

    def keys(self, images: list[bytes | str]) -> list[str]:
        from vitserve.keys import content_key

        return [
            i if isinstance(i, str) else content_key(i, self.fingerprint, self.cfg.namespace)
            for i in images
        ]

    async def _request(self, images: list[bytes | str]) -> list[dict[str, Any]]:
        return await self.flow.encode(images, self.keys(images))

    def request(self, *requests: list[bytes | str]) -> list[list[dict[str, Any]]]:
        """Run the requests concurrently; their answers."""

        async def run() -> list:
            answers = await asyncio.gather(*(self._request(r) for r in requests))
            await self.flow.flight_store.drain()  # the claim releases under way
            await self.encoder.drain_publishes()  # its releases, the publishes past the answers
            return answers

        self.counts.reset()
        return self.loop.run_until_complete(run())

    def images_encoded(self) -> int:
        return self.encoder.engine.counters.images


def _images(n: int, seed: int, size: int = 56) -> list[bytes]:
    return [make_image(size, size, fmt="JPEG", seed=seed + i) for i in range(n)]


@pytest.fixture(scope="module", params=["encoder", "ingress", "deployment"])
def service(request, loop, engine_cfg, store_url) -> Service:
    return Service(loop, engine_cfg, store_url, request.param)


def _serve_calls_per_request(service: Service) -> int:
    return 2 if service.cfg.preprocess_at == "deployment" else 1


def test_one_new_image(service: Service) -> None:
    [answer] = service.request(_images(1, seed=100))
    assert not answer[0]["cached"] and "error" not in answer[0]
    c = service.counts.calls
    assert c["store.lookup_or_claim"] == 1 and c["store.put_values"] == 1
    assert service.counts.store() == 2, c  # lookup-or-claim, publish (+ release): nothing else
    assert service.counts.serve() == _serve_calls_per_request(service), c


def test_eight_images_three_cached(service: Service) -> None:
    images = _images(8, seed=200)
    service.request(images[:3])
    before = service.images_encoded()
    [answer] = service.request(images)
    assert [a["cached"] for a in answer] == [True] * 3 + [False] * 5
    assert service.images_encoded() - before == 5
    c = service.counts.calls
    assert c["store.lookup_or_claim"] == 1
    # the five new images reach the queue in one call and fit the configured cap (not the
    # host's): one device step, so one publish
    assert c["store.put_values"] == 1 and service.counts.store() == 2, c
    assert service.counts.serve() == _serve_calls_per_request(service), c


def test_all_cached_request(service: Service) -> None:
    images = _images(4, seed=300)
    service.request(images)
    before = service.images_encoded()
    [answer] = service.request(images + service.keys(images[:2]))
    assert all(a["cached"] for a in answer)
    assert service.images_encoded() == before
    calls = {k: n for k, n in service.counts.calls.items() if k != "store.stats"}
    assert calls == {"store.lookup_or_claim": 1}


def test_concurrent_requests_sharing_an_image(service: Service) -> None:
    shared, a, b = _images(3, seed=400)
    before = service.images_encoded()
    first, second = service.request([shared, a], [b, shared])
    assert service.images_encoded() - before == 3  # the shared image once
    assert first[0]["key"] == second[1]["key"] and first[0]["num_tokens"] == second[1]["num_tokens"]
    c = service.counts.calls
    assert c["store.lookup_or_claim"] == 2  # one per request
    assert c["store.claim"] == 0
    # each request's new images: one publish per step; the shared image's second request
    # joined the first's flight (on the ingress or the encoder: no store call), or, when its
    # lookup answered before the first request had registered its flight, polled the store
    # (lookup_states, no thread held) until the first one's publish: never a second encode
    assert c["store.put_values"] <= 2 and c["store.headers_many"] == 0, c
    assert service.counts.serve() == 2 * _serve_calls_per_request(service), c


class StoreDownForWaits(CountingStore):
    """The real store, but its single-flight poll and claim fail as a store that went down
    does (``StoreUnavailableError``)."""

    def __getattr__(self, name: str) -> Any:
        if name not in ("lookup_states", "claim"):
            return super().__getattr__(name)

        def down(*args: Any, **kwargs: Any) -> Any:
            from vitserve.errors import StoreUnavailableError

            self._counts.calls[f"store.{name}"] += 1
            raise StoreUnavailableError("test", "down")

        return down


def test_a_busy_image_encoding_here_is_joined_when_the_store_fails_the_wait(
    loop, engine_cfg, store_url
) -> None:
    """An image claimed by another request (``BUSY``) whose encode runs on this replica, with
    the store down: the request joins the encode in flight here at once (it never waits on the
    store, so the store's failure cannot make it encode the image a second time, which could
    answer the same key with other bits)."""
    from vitserve.deployments.encoder.single_flight import ClaimState
    from vitserve.deployments.encoder.wire import EncodeBatch

    service = Service(loop, engine_cfg, store_url, "encoder")
    encoder = service.encoder
    encoder.store = StoreDownForWaits(encoder.store.__dict__["_store"], service.counts)
    image = _images(1, seed=500)[0]
    [key] = service.keys([image])
    joined = {"key": key, "from": "the encode in flight"}
    batch = EncodeBatch(
        keys=[key],
        indices=[0],
        claims=[ClaimState.BUSY],
        token="t",
        images=[image],
        namespace=service.cfg.namespace,
    )

    async def run() -> list:
        in_flight = encoder.pipeline.flights.lead(key)  # this replica encodes the image now
        busy = asyncio.ensure_future(encoder.encode(batch))
        await asyncio.sleep(0.2)  # its wait fails at once: it must not go and encode
        assert not busy.done()
        encoder.pipeline.flights.settle(in_flight, joined)
        return await busy

    before = service.images_encoded()
    assert loop.run_until_complete(run()) == [joined]
    assert service.images_encoded() == before
    assert service.counts.calls["store.lookup_states"] == 0


class HeldPuts:
    """The encoder's store, with its publishes held until ``go`` (a slow store)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.go, self.started = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_values(self, *args: Any, **kwargs: Any) -> None:
        self.started.set()
        assert self.go.wait(60), "the test never let the publish go"
        self._store.put_values(*args, **kwargs)


@pytest.fixture
def held(loop, engine_cfg) -> Iterator[tuple[Service, HeldPuts]]:
    service = Service(loop, engine_cfg, "node://", "encoder")
    held = HeldPuts(service.encoder.store)
    service.encoder.store = held
    yield service, held
    held.go.set()
    loop.run_until_complete(service.encoder.drain_publishes())


def test_a_claimed_images_answer_does_not_wait_for_its_publish_and_its_readers_do(held) -> None:
    """The answer leaves while the record's publish is still under way (the claim is held till
    it lands), and a reader in another process's place (its own store object) that asks for
    the rows meanwhile waits for the publish instead of missing."""
    from vitserve.cache import open_store

    service, puts = held
    image = _images(1, seed=700)
    [key] = service.keys(image)
    reader = open_store("node://", namespace=service.cfg.namespace)

    async def run() -> None:
        try:
            [answer] = await asyncio.wait_for(service.flow.encode(image, [key]), 20)
            assert not puts.go.is_set()  # answered while its publish is held
            assert await asyncio.to_thread(puts.started.wait, 20)  # handed off, not skipped
            rows = answer["num_tokens"]
            read = asyncio.ensure_future(asyncio.to_thread(reader.get_rows_many, [(key, 0, rows)]))
            await asyncio.sleep(0.5)
            assert not read.done()  # the reader waits on the claim
            puts.go.set()
            [record] = await asyncio.wait_for(read, 20)
            assert record is not None and record.num_tokens == rows and record.key == key
        finally:
            puts.go.set()

    service.loop.run_until_complete(run())
    assert reader.stats()["read_waits"] == 1


def test_an_unclaimed_images_answer_waits_for_its_publish(held) -> None:
    """An image encoded without a claim (its store failed the ingress's lookup) has nothing for
    a reader to wait on: its answer leaves only once its record is published."""
    from vitserve.deployments.encoder.single_flight import ClaimState
    from vitserve.deployments.encoder.wire import EncodeBatch

    service, puts = held
    image = _images(1, seed=701)
    [key] = service.keys(image)
    batch = EncodeBatch(
        keys=[key], indices=[0], claims=[ClaimState.UNCLAIMED], token="t", images=image
    )

    async def run() -> None:
        try:
            task = asyncio.ensure_future(service.encoder.encode(batch))
            assert await asyncio.to_thread(puts.started.wait, 20)  # encoded, its publish held
            done, _ = await asyncio.wait({task}, timeout=0.5)
            assert not done  # no answer before the record lands
            puts.go.set()
            [answer] = await asyncio.wait_for(task, 20)
            assert answer["key"] == key
        finally:
            puts.go.set()

    service.loop.run_until_complete(run())
    assert service.encoder.store.get(key) is not None


def test_a_stopping_encoder_lets_the_publishes_it_handed_off_land(held) -> None:
    """``__del__`` (Serve's stop, once the requests are answered) returns only after the
    publishes that ran past their answers have landed: nothing answered is left unpublished."""
    service, puts = held
    image = _images(1, seed=702)
    [key] = service.keys(image)
    [answer] = service.loop.run_until_complete(service.flow.encode(image, [key]))
    assert "error" not in answer and puts.started.wait(20)
    stopping = threading.Thread(target=service.encoder.__del__)
    stopping.start()
    stopping.join(timeout=0.5)
    assert stopping.is_alive()  # waits for the held publish
    puts.go.set()
    stopping.join(timeout=20)
    assert not stopping.is_alive()
    assert service.encoder.store.get(key) is not None


class RefusedPuts:
    """The encoder's store, refusing its first ``refusals`` publishes as unavailable (a
    primary failing over), then its own."""

    def __init__(self, store: Any, refusals: int) -> None:
        self._store = store
        self.refusals = refusals
        self.tries = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def put_values(self, values: Any, *args: Any, **kwargs: Any) -> None:
        from vitserve.errors import StoreUnavailableError

        if values:  # a publish (a claim's release alone passes)
            self.tries += 1
            if self.tries <= self.refusals:
                raise StoreUnavailableError("node://", "refused for the test")
        self._store.put_values(values, *args, **kwargs)


@pytest.mark.parametrize(("refusals", "lands"), [(2, True), (9, False)])
def test_a_publish_refused_as_unavailable_is_tried_again_and_its_readers_wait(
    loop, engine_cfg, refusals: int, lands: bool
) -> None:
    """A claimed image's publish that the store refuses as unavailable: its answer leaves at
    once, the publish is tried again after each of ``PUBLISH_RETRY_S`` with the claim held, and
    a reader asking meanwhile gets the record once it lands, never a miss; refused past the
    last try, it is given up and the claim released (the reader then misses, at once)."""
    from vitserve.cache import open_store
    from vitserve.deployments.encoder.publisher import PUBLISH_RETRY_S

    service = Service(loop, engine_cfg, "node://", "encoder")
    store = RefusedPuts(service.encoder.store, refusals)
    service.encoder.store = store
    image = _images(1, seed=703 + refusals)
    [key] = service.keys(image)
    reader = open_store("node://", namespace=service.cfg.namespace)

    async def run() -> Any:
        [answer] = await asyncio.wait_for(service.flow.encode(image, [key]), 20)
        assert "error" not in answer and store.tries <= 1  # answered, no retry awaited
        read = asyncio.to_thread(reader.get_rows_many, [(key, 0, answer["num_tokens"])])
        [record] = await asyncio.wait_for(read, 30)
        await service.encoder.drain_publishes()
        return record

    record = service.loop.run_until_complete(run())
    if lands:
        assert record is not None and record.key == key and store.tries == refusals + 1
    else:
        assert record is None and store.tries == 1 + len(PUBLISH_RETRY_S)


class HeldEncoder:
    """The encoder's handle, its ``encode`` calls held until ``go`` is set (or failing with
    ``error``): what a reader of the store sees while an encode answered at its claims runs."""

    def __init__(self, handle: CountingHandle, error: Exception | None = None) -> None:
        self.handle = handle
        self.go = asyncio.Event()
        self.error = error

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)
        if name != "encode":
            return method
        held = self

        class Held:
            def remote(self, *args: Any) -> asyncio.Future:
                async def call() -> Any:
                    await held.go.wait()
                    if held.error is not None:
                        raise held.error
                    return await method.remote(*args)

                return asyncio.ensure_future(call())

        return Held()


def _claimed_service(loop, engine_cfg, store_url, error: Exception | None = None) -> Service:
    service = Service(loop, engine_cfg, store_url, "encoder")
    service.flow.encoder = HeldEncoder(service.flow.encoder, error)
    return service


def test_an_encode_answered_at_its_claims_publishes_after(loop, engine_cfg, store_url) -> None:
    """``wait=claimed``: the answer comes while the encoder has not even started (a held
    image described, the new one pending, its claim visible in the store); the encode then runs
    on and publishes the same record an answer at its publish describes."""
    from vitserve.cache.base import Pending
    from vitserve.client.handles import EncodeWait
    from vitserve.deployments.common import metrics

    service = _claimed_service(loop, engine_cfg, store_url)
    held_image, new_image = _images(2, seed=600)
    service.flow.encoder.go.set()
    [[held]] = service.request([held_image])
    service.flow.encoder.go.clear()
    store = service.flow.store
    failures = metrics.counts().value("background_encode_failures_total")

    async def run() -> tuple[list, list, list]:
        keys = service.keys([held_image, new_image])
        answer = await service.flow.encode([held_image, new_image], keys, wait=EncodeWait.CLAIMED)
        states = store.lookup_states(keys)  # the encoder is held: nothing published yet
        service.flow.encoder.go.set()
        await asyncio.gather(*service.flow.background)
        await service.encoder.drain_publishes()
        return answer, states, store.lookup_states(keys)

    answer, before, after = loop.run_until_complete(run())
    assert answer[0] == {**held, "cached": True}
    assert answer[1] == {"key": service.keys([new_image])[0], "pending": True}
    assert before[1] is Pending.CLAIMED and not isinstance(before[0], Pending)
    assert not isinstance(after[1], Pending) and after[1].num_tokens == held["num_tokens"]
    assert not service.flow.background
    assert metrics.counts().value("background_encode_failures_total") == failures


def test_an_encode_answered_at_its_claims_that_fails_after_releases_and_counts(
    loop, engine_cfg, store_url
) -> None:
    """An encode answered at its claims whose encoder call fails after the answer: its claim is
    released (a reader waiting on it reads a miss at once, not at the claim's ttl), the
    failure counted."""
    from vitserve.cache.base import Pending
    from vitserve.client.handles import EncodeWait
    from vitserve.deployments.common import metrics
    from vitserve.errors import ServiceUnavailableError

    service = _claimed_service(loop, engine_cfg, store_url, ServiceUnavailableError("encoder", "x"))
    [image] = _images(1, seed=700)
    [key] = service.keys([image])
    failures = metrics.counts().value("background_encode_failures_total")

    async def run() -> tuple[list, list]:
        answer = await service.flow.encode([image], [key], wait=EncodeWait.CLAIMED)
        service.flow.encoder.go.set()
        await asyncio.gather(*service.flow.background, return_exceptions=True)
        await service.flow.flight_store.drain()  # the release
        return answer, service.flow.store.lookup_states([key])

    answer, states = loop.run_until_complete(run())
    assert answer == [{"key": key, "pending": True}]
    assert states == [Pending.FREE]
    assert metrics.counts().value("background_encode_failures_total") == failures + 1


def test_an_encode_answered_at_its_claims_with_nothing_to_claim_answers_whole(
    loop, engine_cfg, store_url
) -> None:
    """All held, or a key-only item the store lacks: nothing is pending, the answer is the
    one ``published`` gives."""
    from vitserve.client.handles import EncodeWait

    service = _claimed_service(loop, engine_cfg, store_url)
    service.flow.encoder.go.set()
    image = _images(1, seed=800)[0]
    [[first]] = service.request([image])
    absent = "0" * 64

    async def run() -> list:
        keys = [*service.keys([image]), absent]
        return await service.flow.encode([image, absent], keys, wait=EncodeWait.CLAIMED)

    cached, missing = loop.run_until_complete(run())
    assert cached == {**first, "cached": True}
    assert missing["error"]["type"] == "CacheMissError"
    assert not service.flow.background
