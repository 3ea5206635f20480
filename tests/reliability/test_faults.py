"""Injected faults survived, against a real Ray Serve app, real redis-servers and real HTTP.

1. Redis killed in the middle of a load and restarted on the same port: every request
   succeeds (the tiered store's node tier, or recomputing), every embedding equals the
   in-process engine's, and new images land in Redis again once it is back. On a Redis
   Cluster, a primary killed: right answers, a request fails only retryably during the
   election, service back without anyone acting.
2. An encoder replica, then a preprocess replica, killed mid-load: Serve restarts it, the
   SDK's default retries carry what was in flight; nothing lost, one embedding per key.
3. The prefill's store reads failing mid-prefill (entries evicted, the store down): the chat
   request recovers with the undisturbed run's logits and completion, or fails with a clear
   error (404/503, the project's error shape); it never prefills with missing or wrong rows.
4. Entries corrupted in the store (a payload byte flipped, truncated, a header of another
   fingerprint): a fetch is a miss, never the bad bytes; the next encode re-encodes, equal to
   the engine's. The node tier refuses a corrupt value outright.

Two applications serve them all: ``faults-tiered`` (node tier in front of a private Redis) and
``faults-redis`` (a private Redis alone, ``preprocess_at: deployment``).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import App, RedisServer
from tests.reliability.faults import (
    CORRUPTIONS,
    Load,
    check_answers,
    fresh_image,
    kill_while_busy,
    landed_keys,
    landed_value,
    redis_value_key,
    replicas,
    wait_for_replacement,
)

pytestmark = pytest.mark.slow

# The apps' Redis timeout. A killed local server refuses connections at once, so it does not
# slow the outage; it bounds a slow command on the server that came back (its first
# connections load the Lua scripts), which the tiered store would otherwise count as down.
TIMEOUT_S = 2.0


@pytest.fixture(autouse=True)
def _no_load_outlives_its_test() -> Iterator[None]:
    """A test that fails mid-load leaves no client threads encoding into the next test."""
    yield
    Load.stop_all()


def ensure_up(server: RedisServer) -> None:
    """(Re)start ``server`` on its port if a test left it down."""
    if server.proc is None or server.proc.poll() is not None:
        port = server.port
        server.start()
        assert server.port == port, "redis-server could not take its port again"


@pytest.fixture(scope="module")
def redis_a() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_b() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def tiered_app(deploy: Callable[..., App], redis_a: RedisServer) -> Iterator[App]:
    from vitserve.cache.urls import tiered_url

    store = tiered_url("node://", f"{redis_a.url}?timeout_s={TIMEOUT_S}")
    app = deploy("faults-tiered", store=store, batching={"batch_wait_timeout_s": 0.02})
    yield app
    deploy.remove(app.name)


@pytest.fixture(scope="module")
def redis_app(deploy: Callable[..., App], redis_b: RedisServer) -> Iterator[App]:
    app = deploy(
        "faults-redis",
        store=f"{redis_b.url}?timeout_s={TIMEOUT_S}",
        preprocess_at="deployment",
        batching={"batch_wait_timeout_s": 0.02},
    )
    yield app
    deploy.remove(app.name)


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def missing_at_the_end(app: App, keys: set[str]) -> list[str]:
    """Keys answered during a load that the service no longer holds (data lost): probed
    through the SDK, in the batches the service accepts."""
    from vitserve.client import EncoderClient

    with EncoderClient(app.url) as client:
        held = client.probe(sorted(keys))
    return [k for k, h in zip(sorted(keys), held, strict=True) if h is None]


# -- 1. Redis killed and restarted -------------------------------------------------------------
def test_redis_killed_mid_load_and_restarted(
    tiered_app: App, redis_a: RedisServer, engines, reliability
) -> None:

    from vitserve.cache.redis_store import RedisStore
    from vitserve.client import EncoderClient

    ensure_up(redis_a)
    ns = tiered_app.config.namespace
    load = Load(tiered_app.url, threads=3).start()
    # Phases by progress, not by the clock: each ends once the load did what it must show
    # (a slow or busy machine only makes them longer).
    warm = load.wait(lambda: load.repeats_answered() and len(load.answers) >= 6, 120)
    redis_a.kill()
    down_at = time.monotonic()
    served_down = load.wait(lambda: load.answered_since(down_at, new=True) >= 3, 60)
    sleep_until(down_at + 2)  # down for at least 2 s
    ensure_up(redis_a)
    up_at = time.monotonic()
    late_from = up_at + 1.0  # after a grace for the pool to reconnect
    served_up = load.wait(lambda: load.answered_since(late_from, new=True) >= 3, 60)
    unanswered = load.stop()
    repeat_keys = sorted({a.key for a in load.answers if a.image in load.repeats})

    with EncoderClient(tiered_app.url) as client:  # recovered on its own: a new image lands
        [after] = client.encode([fresh_image()])
    direct = RedisStore(redis_a.url, namespace=ns, timeout_s=2)
    try:
        late = [a.key for a in load.answers if not a.cached and a.started >= late_from]
        in_redis = landed_keys(direct, [after.key, *late])  # published after the answer
        repeats_in_redis = direct.exists_many(repeat_keys)
    finally:
        direct.close()
    during = [a for a in load.answers if down_at <= a.started < up_at]
    wrong, differing = check_answers(load.answers, engines["qwen2_vl"])
    gone = missing_at_the_end(tiered_app, {a.key for a in load.answers})

    assert warm and served_down and served_up, (warm, served_down, served_up, load.failures[:3])
    assert load.failures == [], load.failures[:5]
    assert unanswered == 0
    assert any(not a.cached for a in during), "no new image answered while down"
    assert wrong == [] and differing == []
    assert gone == []
    # recovered on its own: the new images after the restart (and one more) reach Redis ...
    assert late and not after.cached and all(in_redis), (len(late), in_redis)
    # ... which came back empty: the repeated images, published before the kill and served
    # from the local tier since, are not there
    assert repeat_keys and not any(repeats_in_redis), repeats_in_redis
    reliability.record(
        "Redis killed mid-load and restarted (tiered store)",
        tried=load.tried,
        failed=len(load.failures),
        wrong=len(wrong) + len(differing),
        lost=unanswered + len(gone),
        note=f"3 SDK clients, Redis down {up_at - down_at:.1f} s; {len(during)} answered "
        f"while it was down, {len(late)} new ones after it came back, "
        f"{load.retries} retries",
    )


# -- 1b. a Redis Cluster primary killed -----------------------------------------------------------
def test_a_redis_cluster_primary_killed_mid_load(
    deploy: Callable[..., App], spawn_redis_cluster, engines, reliability
) -> None:
    """An application on a Redis Cluster (three primaries, a replica each) under three SDK
    clients; the primary holding a repeated image's record is killed. Every answer equals the
    in-process engine's; a request fails only with a retryable error, while the replica is
    promoted; then new images are answered and land again, nobody acting. A record the dead
    primary held and its replica had not yet copied would be lost: it is counted, and encoded
    again (right) when asked."""
    from vitserve.client import EncoderClient

    cluster = spawn_redis_cluster(masters=3, replicas=1)
    app = deploy(
        "faults-cluster",
        store=f"{cluster.url}?timeout_s={TIMEOUT_S}",
        batching={"batch_wait_timeout_s": 0.02},
    )
    try:
        load = Load(app.url, threads=3).start()
        warm = load.wait(lambda: load.repeats_answered() and len(load.answers) >= 6, 120)
        repeated = next(a.key for a in load.answers if a.image in load.repeats)
        victim = cluster.primary_of(f"vsm:v:{{{app.config.namespace}/{repeated}}}")
        victim.kill()
        down_at = time.monotonic()
        cluster.wait_healthy()
        healed_at = time.monotonic()
        served = load.wait(lambda: load.answered_since(healed_at + 1.0, new=True) >= 3, 60)
        unanswered = load.stop()
        wrong, differing = check_answers(load.answers, engines["qwen2_vl"])
        gone = missing_at_the_end(app, {a.key for a in load.answers})
        lost_images = [next(a.image for a in load.answers if a.key == k) for k in gone]
        with EncoderClient(app.url) as client:  # what was lost is encoded again, right
            again = client.encode(lost_images) if lost_images else []
        redone, _ = check_answers([a for a in load.answers if a.key in gone], engines["qwen2_vl"])
    finally:
        deploy.remove(app.name)
    assert warm and served, (warm, served, load.failures[:3])
    assert all("Unavailable" in f for f in load.failures), load.failures[:5]
    assert unanswered == 0
    assert wrong == [] and differing == []
    assert [h.key for h in again] == gone and not any(h.cached for h in again) and redone == []
    reliability.record(
        "Redis Cluster primary killed mid-load (3 primaries, 3 replicas)",
        tried=load.tried,
        failed=len(load.failures),
        wrong=len(wrong) + len(differing),
        lost=unanswered + len(gone),
        note=f"3 SDK clients, default retries ({load.retries} made); election "
        f"{healed_at - down_at:.1f} s; lost records encoded again when asked",
    )


# -- 2. replicas killed ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "app_fixture, deployment",
    [("tiered_app", "EncoderDeployment"), ("redis_app", "PreprocessDeployment")],
    ids=["encoder", "preprocess"],
)
def test_a_replica_killed_mid_load(
    app_fixture: str, deployment: str, request, engines, reliability
) -> None:
    app: App = request.getfixturevalue(app_fixture)
    ensure_up(request.getfixturevalue("redis_a" if app_fixture == "tiered_app" else "redis_b"))
    load = Load(app.url, threads=3).start()
    # each repeated image answered first: the kill hits requests, not their first encodes
    warm = load.wait(lambda: load.repeats_answered() and len(load.answers) >= 6, 120)
    assert warm, load.failures[:3]
    [(name, actor)] = replicas(app.name, deployment)
    busy = kill_while_busy(actor)
    killed_at = time.monotonic()
    assert wait_for_replacement(app.name, deployment, name, 60)
    replaced_at = time.monotonic()
    answered = load.wait(lambda: load.answered_since(replaced_at) >= 6, 60)
    unanswered = load.stop()

    wrong, differing = check_answers(load.answers, engines["qwen2_vl"])
    gone = missing_at_the_end(app, {a.key for a in load.answers})

    # A request was in the replica when it died: Serve's router retries some such requests
    # itself, the others reach the SDK as 503s and are retried there (``load.retries``).
    assert busy, "no request was in flight when the replica died"
    assert answered, f"{load.answered_since(replaced_at)} answers after the restart"
    assert load.failures == [], load.failures[:5]
    assert unanswered == 0
    assert wrong == [] and differing == []
    assert gone == []
    kind = deployment.removesuffix("Deployment").lower()
    reliability.record(
        f"{kind.capitalize()} replica killed mid-load (ray.kill)",
        tried=load.tried,
        failed=len(load.failures),
        wrong=len(wrong) + len(differing),
        lost=unanswered + len(gone),
        note=f"3 SDK clients, default retries ({load.retries} made); restarted in "
        f"{replaced_at - killed_at:.0f} s",
    )


# -- 3. the prefill's reads failing --------------------------------------------------------------
def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _chat_body(urls: list[str]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "compare:"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "temperature": 0, "max_tokens": 4}


LABELS = {
    "same": "recovered with the undisturbed logits and completion",
    "CacheMissError": "refused 404 CacheMissError (named by key, gone everywhere)",
    "StoreUnavailableError": "refused 503 StoreUnavailableError (the only store down)",
}


class FaultyReads:
    """The client's direct store with ``fault()`` run once, just before its ``at``-th row read
    (the first chunk's rows are already in the prefill by then)."""

    def __init__(self, store: Any, fault: Callable[[], None], at: int = 2) -> None:
        self.calls = 0
        real = store.get_rows_many

        def get_rows_many(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == at:
                fault()
            return real(*args, **kwargs)

        store.get_rows_many = get_rows_many


@pytest.fixture(scope="module")
def chat_service(tiered_app: App) -> Any:
    """The prefill replicas' code in-process (its client set per case), 16-token chunks."""
    from vitserve.deployments.prefill.chat_service import ChatService

    prefill = tiered_app.config.prefill.model_copy(update={"chunk_size": 16})
    return ChatService(tiered_app.config.model_copy(update={"prefill": prefill}), client=None)


def _prefill(service: Any, body: dict[str, Any]) -> tuple[Any, str]:
    prepared = service.prepare(body, keep_logits=True)
    return prepared.prefilled.all_logits, service.complete(prepared)["choices"][0]["message"][
        "content"
    ]


def _client(app: App, server: RedisServer) -> Any:
    from vitserve.client import EncoderClient, RetryPolicy

    retry = RetryPolicy(attempts=3, backoff_s=0.05, max_backoff_s=0.2, max_retry_after_s=0.2)
    return EncoderClient(app.url, store=f"{server.url}?timeout_s={TIMEOUT_S}", retry=retry)


def test_prefill_store_reads_failing_mid_prefill(
    chat_service, tiered_app, redis_a, redis_app, redis_b, reliability
) -> None:
    """Each case: an undisturbed prefill of two images, then the same prompt with a fault
    injected between the first chunk's read and the next (the client reads Redis directly,
    as an LLM server on another node would)."""
    import redis

    from vitserve.deployments.common.responses import error_response
    from vitserve.errors import CacheMissError, StoreUnavailableError, VitserveError

    outcomes: dict[str, list[str]] = {"evicted": [], "down": []}
    wrong = 0

    def case(app: App, server: RedisServer, kind: str, by_key: bool = False) -> str:
        """``"same"`` (recovered, equal to the undisturbed run) or the error's type."""
        nonlocal wrong
        ensure_up(server)
        images = [fresh_image((96, 72)), fresh_image((64, 48))]
        with _client(app, server) as client:
            chat_service.client = client
            body = _chat_body([_data_url(i) for i in images])
            want_logits, want_text = _prefill(chat_service, body)
            if by_key:  # the images named by key: the client holds no bytes to re-encode
                body = _chat_body([f"vitserve://{h.key}" for h in client.encode(images)])
            keys = [h.key for h in client.encode(images)]
            ns = app.config.namespace
            raw = redis.Redis.from_url(server.url)

            def evict() -> None:
                for k in keys:  # published, not only handed off: else the eviction comes first
                    landed_value(raw, redis_value_key(ns, k))
                raw.delete(*(redis_value_key(ns, k) for k in keys))

            FaultyReads(client.core.store, evict if kind == "evicted" else server.kill)
            try:
                logits, text = _prefill(chat_service, body)
            except VitserveError as exc:
                answer = error_response(exc)
                doc = json.loads(answer.body)["error"]
                assert doc["type"] == type(exc).__name__ and doc["message"]
                assert answer.status_code in (404, 503), answer.status_code
                if isinstance(exc, CacheMissError):
                    assert set(exc.keys) <= set(keys)
                else:
                    assert isinstance(exc, StoreUnavailableError), exc
                outcomes[kind].append(doc["type"])
                return doc["type"]
            finally:
                raw.close()
            same = text == want_text and torch.allclose(logits, want_logits, atol=1e-5)
            wrong += not same
            outcomes[kind].append("same" if same else "WRONG")
            return "same" if same else "wrong"

    # The tiered app's node tier still holds the rows: evicted or down, a prefill recovers.
    assert case(tiered_app, redis_a, "evicted") == "same"
    assert case(tiered_app, redis_a, "down") == "same"
    assert case(tiered_app, redis_a, "evicted", by_key=True) == "same"
    # Redis alone: evicted rows are re-encoded from the request's images; named by key they
    # cannot be (a clear 404); the store down is a 503.
    assert case(redis_app, redis_b, "evicted") == "same"
    assert case(redis_app, redis_b, "evicted", by_key=True) == "CacheMissError"
    assert case(redis_app, redis_b, "down") == "StoreUnavailableError"
    ensure_up(redis_a)
    ensure_up(redis_b)
    assert wrong == 0
    for kind, label in (("evicted", "entries evicted"), ("down", "the store down")):
        results = outcomes[kind]
        reliability.record(
            f"Prefill: {label} mid-prefill",
            tried=len(results),
            failed=0,
            wrong=wrong,
            lost=0,
            note=", ".join(f"{results.count(r)} {LABELS.get(r, r)}" for r in sorted(set(results))),
        )


# -- 4. corrupted entries ----------------------------------------------------------------------
def _fetch_is_never_bad(app: App, key: str, want: torch.Tensor) -> int:
    """GET the embedding: a miss (404) or the right rows; the status."""
    from vitserve.cache.codec import decode_record
    from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart

    response = app.client.get(f"{app.url}/v1/embeddings/{key}")
    if response.status_code == 200:
        got = torch.from_numpy(np.array(decode_record(response.content, key=key).embedding))
        assert got.shape == want.shape and ulps_apart(got, want) <= BATCH_TOLERANCE_ULPS["fp32"]
    else:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["type"] == "CacheMissError"
    return response.status_code


def test_corrupted_entries_are_misses_and_re_encoded(
    tiered_app, redis_a, redis_app, redis_b, engines, reliability
) -> None:
    import redis
    from prometheus_client import CollectorRegistry

    from vitserve.cache.codec import encode_record, unpack_records
    from vitserve.cache.node import NodeStore
    from vitserve.client import EncoderClient
    from vitserve.deployments.encoder.records import embedding_record

    engine = engines["qwen2_vl"]
    requests = 0

    def corrupt_and_recover(
        app: App,
        server: RedisServer,
        corrupt: Callable[[Any, str], None],
        before: Callable[[str], None] = lambda key: None,
    ) -> None:
        nonlocal requests
        ensure_up(server)
        image = fresh_image()
        want = engine.encode([image])[0]
        key = app.encode([image]).json()["items"][0]["key"]
        raw = redis.Redis.from_url(server.url)
        landed_value(raw, redis_value_key(app.config.namespace, key))  # both tiers hold it
        before(key)
        corrupt(raw, redis_value_key(app.config.namespace, key))
        raw.close()
        assert _fetch_is_never_bad(app, key, want.tensor) == 404  # detected: a miss
        rows = app.client.post(f"{app.url}/v1/rows", json={"reads": [[key, 0, 2]]})
        assert rows.status_code == 200 and unpack_records(rows.content) == [None]
        images = app.counters()["images"]
        again = app.encode([image]).json()["items"][0]
        assert again["key"] == key and again["cached"] is False  # re-encoded
        assert app.counters()["images"] == images + 1
        assert _fetch_is_never_bad(app, key, want.tensor) == 200
        requests += 5

    for corrupt in CORRUPTIONS.values():  # Redis alone
        corrupt_and_recover(redis_app, redis_b, corrupt)

    # The tiered store: the bad value is the shared tier's (this node's tier lost its copy).
    ns = tiered_app.config.namespace
    node = NodeStore(namespace=ns, read_cache_bytes=0)
    for corrupt in CORRUPTIONS.values():
        corrupt_and_recover(tiered_app, redis_a, corrupt, before=lambda key: node.delete(key))

    # The SDK re-encodes a corrupt entry it meets in a fetch, in the same call.
    registry = CollectorRegistry()
    with EncoderClient(tiered_app.url, registry=registry) as client:
        image = fresh_image()
        [handle] = client.encode([image])
        raw = redis.Redis.from_url(redis_a.url)
        landed_value(raw, redis_value_key(ns, handle.key))  # both tiers hold it
        node.delete(handle.key)
        CORRUPTIONS["payload byte flipped"](raw, redis_value_key(ns, handle.key))
        raw.close()
        [record] = client.fetch([handle])
        assert np.array_equal(record.embedding, engine.encode([image])[0].tensor.numpy())
        assert registry.get_sample_value("vitserve_client_reencoded_total") == 1
        requests += 2

    # The node tier checks every value in full when it is put: a corrupt one is refused.
    image = fresh_image()
    [emb] = engine.encode([image])
    value = bytearray(encode_record(embedding_record(emb, engine.fingerprint)))
    value[-9] ^= 0xFF
    rejected = node.stats()["rejected"]
    node.put_values([(emb.key, bytes(value))])
    assert node.stats()["rejected"] == rejected + 1
    assert node.get(emb.key) is None
    node.close()
    requests += 1
    reliability.record(
        "Store entries corrupted (payload byte flipped, truncated, another model's header)",
        tried=requests,
        failed=0,
        wrong=0,
        lost=0,
        note="Redis alone and tiered; every corrupt read a miss, then re-encoded",
    )


def test_an_upstream_replica_death_is_a_retryable_503() -> None:
    """Serve's own error for a call whose argument's replica (the preprocess) died, caused by
    Ray's ActorDiedError, is the ingress's 503; other errors are not."""
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import RayServeException

    from vitserve.deployments.encoder.encode_flow import unavailable

    upstream = RayServeException("an upstream actor died before finishing a dependent task")
    upstream.__cause__ = ActorDiedError()
    err = unavailable(upstream)
    assert err is not None and err.http_status == 503 and err.retryable
    assert "ActorDiedError upstream" in str(err)
    assert unavailable(RayServeException("a deployment's own bug")) is None
    assert unavailable(ValueError("no")) is None
