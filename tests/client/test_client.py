"""The client SDK against a running vitserve (real Ray Serve app, real HTTP, real Redis).

Every behavioural test runs twice, with ``EncoderClient`` and with ``AsyncEncoderClient``
(driven call by call on one event loop), so both pass the same suite.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.blocking import Blocking
from tests.store_reads import expected_read_bytes
from vitserve.client import AsyncEncoderClient, EncoderClient, ImageHandle, RetryPolicy
from vitserve.errors import CacheMissError, StoreUnavailableError
from vitserve.keys import content_key
from vitserve.testing.images import make_image

pytestmark = pytest.mark.slow


@pytest.fixture(params=["sync", "async"])
def make_client(request) -> Iterator[Callable[..., Any]]:
    """``make_client(url, **kw)``: an EncoderClient, or a Blocking AsyncEncoderClient."""
    made: list[Any] = []

    def make(*args: Any, **kw: Any) -> Any:
        client = (
            EncoderClient(*args, **kw)
            if request.param == "sync"
            else Blocking(AsyncEncoderClient(*args, **kw))
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


_seed = iter(range(10_000, 10**9))


def fresh_images(n: int, sizes: tuple[tuple[int, int], ...] = ((64, 48), (96, 72))) -> list[bytes]:
    """``n`` images no test has sent before (sizes cycle through ``sizes``)."""
    return [make_image(*sizes[i % len(sizes)], seed=next(_seed)) for i in range(n)]


def encoded_images(app) -> int:
    return app.counters()["images"]


# -- hash first --------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["store-probe", "http-probe"])
def test_encode_uploads_only_what_the_store_lacks(
    make_client, redis_app, redis_url, direct: bool
) -> None:
    client = make_client(redis_app.url, store=redis_url if direct else None)
    images = fresh_images(3)
    before = encoded_images(redis_app)
    handles = client.encode(images)
    assert [h.cached for h in handles] == [False] * 3
    assert encoded_images(redis_app) == before + 3
    model = client.describe()
    assert [h.key for h in handles] == [
        content_key(b, model["fingerprint"], model["namespace"]) for b in images
    ]
    # the service's own answer for the same images agrees, field by field
    served = redis_app.encode(images).json()["items"]
    assert [ImageHandle.from_item(item) for item in served] == [
        ImageHandle(**{**vars_of(h), "cached": True}) for h in handles
    ]

    new = fresh_images(1)
    again = client.encode([*images, *new, images[0]])
    assert [h.cached for h in again] == [True, True, True, False, True]
    assert encoded_images(redis_app) == before + 4  # just the new image
    assert again[4] == again[0]

    routes = count_routes(client)
    assert all(h.cached for h in client.encode(images))
    assert encoded_images(redis_app) == before + 4
    # an all-cached call makes no encoder call: its only API call is the probe, if any
    assert routes == ([] if direct else ["probe"])


@pytest.mark.parametrize("transport", ["http", "handle"])
def test_submit_answers_at_the_claims_and_the_record_follows(
    make_client, node_app, redis_app, redis_url, transport: str
) -> None:
    """``submit``: one probe, an upload of only the new image, answered once it is claimed
    (pending, the held one with its handle), through HTTP and the Serve handle; the record
    then comes to the store under the same key, and ``encode`` of the same images finds both."""
    from ray import serve

    from vitserve.cache.base import Pending

    if transport == "http":
        app, client = redis_app, make_client(redis_app.url, store=redis_url)
    else:
        app = node_app
        handle = serve.get_deployment_handle("Ingress", app_name=node_app.name)
        client = make_client(handle=handle, store="node://")
    held, new = fresh_images(2)
    [first] = client.encode([held])
    before = encoded_images(app)
    routes = count_routes(client)
    submitted = client.submit([held, new, new])
    assert routes == ["encode"]  # the probe read the store directly
    assert [s.pending for s in submitted] == [False, True, True]
    assert submitted[0].handle == ImageHandle(**{**vars_of(first), "cached": True})
    assert [s.uploaded for s in submitted] == [False, True, True]
    store = client.core.store
    key = submitted[1].key
    assert store.wait_for(key, 30)  # the claim is held until the publish
    assert store.lookup_states([key]) != [Pending.FREE]
    again = client.encode([held, new])
    assert [h.cached for h in again] == [True, True] and again[1].key == key
    assert encoded_images(app) == before + 1


def test_a_wait_the_service_does_not_know_is_refused(redis_app) -> None:
    import httpx

    image = fresh_images(1)[0]
    answer = httpx.post(
        f"{redis_app.url}/v1/encode?wait=soon", files={"images": ("0", image)}, timeout=30
    )
    assert answer.status_code == 422, answer.text
    assert "wait='soon'" in answer.json()["error"]["message"]


def count_routes(client: Any) -> list[str]:
    """The routes of the API calls ``client`` makes from now on (its transport wrapped)."""
    routes: list[str] = []
    transport = client.transport
    call = transport.call
    if asyncio.iscoroutinefunction(call):

        async def counting(op: Any) -> Any:
            routes.append(op.route)
            return await call(op)
    else:

        def counting(op: Any) -> Any:
            routes.append(op.route)
            return call(op)

    transport.call = counting
    return routes


def vars_of(handle: ImageHandle) -> dict[str, Any]:
    return {f: getattr(handle, f) for f in handle.__slots__}


def test_images_as_paths_bytes_and_pil_images_key_alike(make_client, redis_app, tmp_path) -> None:
    from PIL import Image

    data = fresh_images(1)[0]
    path = tmp_path / "a.png"
    path.write_bytes(data)
    client = make_client(redis_app.url)
    by_bytes, by_path, by_str = client.encode([data, path, str(path)])
    assert by_bytes.key == by_path.key == by_str.key
    import io

    [by_pil] = client.encode([Image.open(io.BytesIO(data))])  # saved as PNG: its own key
    assert by_pil.num_tokens == by_bytes.num_tokens


# -- fetch per chunk -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["redis", "node"])
def test_fetch_chunk_reads_only_the_rows_it_covers(
    make_client, redis_app, node_app, redis_url, kind: str
) -> None:
    from vitserve.cache import open_store

    app = redis_app if kind == "redis" else node_app
    client = make_client(app.url, store=redis_url if kind == "redis" else "node://")
    # three images of different sizes; text between them
    images = fresh_images(3, sizes=((320, 320), (64, 48), (200, 120)))
    handles = client.encode(images)
    tokens = [h.num_tokens for h in handles]
    assert tokens[0] >= 64 and len(set(tokens)) == 3, tokens
    offsets = [7, 7 + tokens[0] + 5, 7 + tokens[0] + 5 + tokens[1] + 3]
    length = offsets[2] + tokens[2] + 4
    whole = client.fetch(handles)
    store = client.core.store
    model = client.describe()
    url = redis_url if kind == "redis" else "node://"
    checker = open_store(url, namespace=model["namespace"], fingerprint=model["fingerprint"])
    first_read = {h.key for h in handles} - set(client.core.headers)
    cuts = [(10, 40), (30, offsets[1] + 2), (offsets[1] + 1, offsets[2] + 9), (0, length)]
    for start, end in cuts:
        before = store.stats()["bytes_read"]
        chunk = client.fetch_chunk(handles, offsets, start, end)
        moved = store.stats()["bytes_read"] - before
        reads = [(handles[p.image].key, p.row_start, p.row_end) for p in chunk.pieces]
        expected = expected_read_bytes(checker, reads, first_read)
        assert moved == expected, (start, end)
        for piece, rows, extras in zip(chunk.pieces, chunk.embeddings, chunk.extras, strict=True):
            ref = whole[piece.image]
            assert np.array_equal(rows, ref.embedding[piece.row_start : piece.row_end])
            assert not rows.flags.writeable and rows.base is not None  # a view, not a copy
            assert extras.keys() == ref.extras.keys()
    # a chunk inside the first image never reads the whole image
    before = store.stats()["bytes_read"]
    client.fetch_chunk(handles, offsets, 20, 40)
    image_bytes = tokens[0] * handles[0].row_bytes
    assert store.stats()["bytes_read"] - before < image_bytes / 2


def test_iter_chunks_prefetches_the_next_chunk(redis_app, redis_url) -> None:
    """While the caller holds chunk i, chunk i+1's read has already happened."""
    import time

    with EncoderClient(redis_app.url, store=redis_url) as client:
        handles = client.encode(fresh_images(2, sizes=((320, 320),)))
        offsets = [0, handles[0].num_tokens]
        length = offsets[1] + handles[1].num_tokens
        client.fetch(handles)  # headers cached: each chunk is one read
        store = client.core.store
        chunks = client.iter_chunks(handles, offsets, length, chunk_size=32)
        first = next(chunks)
        deadline = time.monotonic() + 5
        while store.stats()["hits"] < 3 + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        hits = store.stats()["hits"]
        assert hits >= 2 + 1 + 1, "the second chunk was not read ahead"
        rest = list(chunks)
        assert first.start == 0 and [c.start for c in rest] == list(range(32, length, 32))


def test_async_iter_chunks_prefetches_the_next_chunk(redis_app, redis_url) -> None:
    async def main() -> None:
        async with AsyncEncoderClient(redis_app.url, store=redis_url) as client:
            handles = await client.encode(fresh_images(2, sizes=((320, 320),)))
            offsets = [0, handles[0].num_tokens]
            length = offsets[1] + handles[1].num_tokens
            await client.fetch(handles)
            store = client.core.store
            hits = store.stats()["hits"]
            seen = []
            async for chunk in client.iter_chunks(handles, offsets, length, chunk_size=32):
                for _ in range(500):  # let the read-ahead task run while we "compute"
                    if store.stats()["hits"] > hits + len(seen) + 1 or chunk.end == length:
                        break
                    await asyncio.sleep(0.01)
                read = store.stats()["hits"] - hits
                seen.append(chunk.start)
                if chunk.end < length:
                    assert read > len(seen), "the next chunk was not read ahead"
            assert seen == list(range(0, length, 32))

    asyncio.run(main())


def test_fetch_chunk_moves_rows_to_a_torch_device(make_client, redis_app, redis_url) -> None:
    import torch

    client = make_client(redis_app.url, store=redis_url)
    handles = client.encode(fresh_images(2))
    offsets = [3, 3 + handles[0].num_tokens]
    plain = client.fetch_chunk(handles, offsets, 0, offsets[1] + 4)
    moved = client.fetch_chunk(handles, offsets, 0, offsets[1] + 4, device="cpu")
    for a, t in zip(plain.embeddings, moved.embeddings, strict=True):
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
        assert torch.equal(t, torch.from_numpy(np.array(a)))


# -- entries gone before their fetch ---------------------------------------------------------
def test_an_evicted_entry_is_encoded_again_when_the_client_has_the_image(
    make_client, redis_app, redis_url
) -> None:
    client = make_client(redis_app.url, store=redis_url)
    handles = client.encode(fresh_images(2))
    offsets = [0, handles[0].num_tokens]
    want = client.fetch(handles)
    client.core.store.delete([h.key for h in handles])
    before = encoded_images(redis_app)
    chunk = client.fetch_chunk(handles, offsets, 0, offsets[1] + handles[1].num_tokens)
    assert encoded_images(redis_app) == before + 2
    for piece, rows in zip(chunk.pieces, chunk.embeddings, strict=True):
        assert np.allclose(
            rows, want[piece.image].embedding[piece.row_start : piece.row_end], rtol=0, atol=1e-5
        )

    # handles without their images (say, built from a probe): every missing key is named
    bare = [h for h in client.probe([h.key for h in handles]) if h is not None]
    assert len(bare) == 2 and all(h.source is None for h in bare)
    client.core.store.delete([h.key for h in bare])
    with pytest.raises(CacheMissError) as caught:
        client.fetch_chunk(bare, offsets, 0, offsets[1] + 1)
    assert sorted(caught.value.keys) == sorted(h.key for h in bare)
    # one retry after re-encoding them recovers
    client.encode([h.source for h in handles])
    assert len(client.fetch_chunk(bare, offsets, 0, offsets[1] + 1).pieces) == 2


# -- the multi-turn agent scenario ----------------------------------------------------------------
def test_multi_turn_uploads_and_encodes_one_image_per_turn(
    make_client, redis_app, redis_url
) -> None:
    """Each turn re-sends the whole conversation's images plus one new one (32 turns)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    client = make_client(redis_app.url, store=redis_url, registry=registry)

    def uploads() -> float:
        return registry.get_sample_value("vitserve_client_uploads_total") or 0.0

    conversation: list[bytes] = []
    for turn in range(1, 33):
        conversation += fresh_images(1)
        sent, encoded = uploads(), encoded_images(redis_app)
        handles = client.encode(conversation)
        assert [h.cached for h in handles] == [True] * (turn - 1) + [False], turn
        assert uploads() - sent == 1, turn
        assert encoded_images(redis_app) - encoded == 1, turn
    assert registry.get_sample_value("vitserve_client_hits_total") == sum(range(32))


def test_an_image_whose_publish_is_under_way_is_waited_for_not_sent_again(
    make_client, redis_app, redis_url
) -> None:
    """The store holds the claim of an image whose record is still being published (the
    encoder answers before its record lands; another caller's encode is in flight): ``encode``
    of it waits for the record instead of uploading the image again (a race the multi-turn test
    above met on a loaded host: turn 28 uploaded turn 27's image a second time)."""
    import threading
    import time

    from prometheus_client import CollectorRegistry

    from vitserve.cache import open_store

    registry = CollectorRegistry()
    client = make_client(redis_app.url, store=redis_url, registry=registry)
    image = fresh_images(1)
    [first] = client.encode(image)
    model = client.describe()
    store = open_store(redis_url, namespace=model["namespace"], fingerprint=model["fingerprint"])
    value = store.get_value(first.key)
    store.delete([first.key])
    assert store.claim(first.key, 30.0, token="publisher")

    def publish() -> None:
        time.sleep(0.5)
        store.put_values([(first.key, value)], None, [(first.key, "publisher")])

    uploads = registry.get_sample_value("vitserve_client_uploads_total")
    encoded = encoded_images(redis_app)
    publisher = threading.Thread(target=publish)
    publisher.start()
    started = time.monotonic()
    [again] = client.encode(image)
    waited = time.monotonic() - started
    publisher.join()
    store.close()
    assert again.cached and again.key == first.key and waited >= 0.4, (again, waited)
    assert registry.get_sample_value("vitserve_client_uploads_total") == uploads
    assert encoded_images(redis_app) == encoded


def test_sdk_metrics(make_client, redis_app, redis_url) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    client = make_client(redis_app.url, store=redis_url, registry=registry)
    old, new = fresh_images(1), fresh_images(2)
    client.encode(old)
    handles = client.encode([*old, *new])
    chunk = client.fetch_chunk(handles, [0, 100, 200], 0, 250)

    def value(name: str) -> float:
        return registry.get_sample_value(f"vitserve_client_{name}") or 0.0

    assert value("probes_total") == 4 and value("hits_total") == 1
    assert value("uploads_total") == 3
    assert value("bytes_uploaded_total") == len(old[0]) + sum(map(len, new))
    assert value("bytes_skipped_total") == len(old[0])
    assert value("rows_fetched_total") == chunk.rows > 0
    assert value("bytes_fetched_total") == sum(
        a.nbytes + sum(x.nbytes for x in e.values())
        for a, e in zip(chunk.embeddings, chunk.extras, strict=True)
    )
    assert value("fetch_seconds_count") == 1


# -- transports ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flavor", ["sync", "async"])
def test_the_serve_handle_transport_answers_as_http_does(node_app, flavor: str) -> None:
    """Inside the cluster (this test process is a Ray driver): the ingress's handle instead
    of HTTP, rows through the handle too (no store given)."""
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", app_name=node_app.name)
    images = fresh_images(2)
    with EncoderClient(node_app.url) as http:
        want = http.encode(images)
        want_chunk = http.fetch_chunk(want, [0, 50], 10, 60)
    client = (
        EncoderClient(handle=handle)
        if flavor == "sync"
        else Blocking(AsyncEncoderClient(handle=handle))
    )
    try:
        got = client.encode(images)
        assert got == [ImageHandle(**{**vars_of(h), "cached": True}) for h in want]
        chunk = client.fetch_chunk(got, [0, 50], 10, 60)
        assert chunk.pieces == want_chunk.pieces
        for a, b in zip(chunk.embeddings, want_chunk.embeddings, strict=True):
            assert np.array_equal(a, b)
    finally:
        client.close()


# -- faults between calls ------------------------------------------------------------------------
def test_a_store_outage_is_reported_as_such_and_recovers(make_client, deploy, spawn_redis) -> None:
    server = spawn_redis()
    app = deploy(f"client-outage-{server.port}", store=server.url)  # its own, per client flavor
    try:
        _outage(make_client, app, server)
    finally:
        deploy.remove(app.name)


def _outage(make_client, app, server) -> None:
    fast = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.05, max_retry_after_s=0.05)
    direct = make_client(app.url, store=server.url, retry=fast)
    via_http = make_client(app.url, retry=fast)
    images = fresh_images(2)
    handles = direct.encode(images)
    assert via_http.probe([h.key for h in handles]) == [
        ImageHandle(**{**vars_of(h), "cached": True, "source": None}) for h in handles
    ]
    server.kill()
    for client in (direct, via_http):
        with pytest.raises(StoreUnavailableError) as caught:
            client.probe([h.key for h in handles])
        assert caught.value.retryable
        with pytest.raises(StoreUnavailableError):
            client.fetch_chunk(handles, [0, 100], 0, 120)
    server.start()  # same port, empty: nothing stale can be served
    again = direct.encode(images)
    assert [h.cached for h in again] == [False, False]
    assert [h.key for h in again] == [h.key for h in handles]


def _encoder_replicas(app_name: str) -> list[Any]:
    import ray

    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "EncoderDeployment" in a["name"] and f"{app_name}#" in a["name"]
    ]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names]


def test_an_encoder_restart_between_calls_is_retried(make_client, deploy) -> None:
    import ray

    app = deploy("client-restart")  # both client flavors kill its replica in turn
    patient = RetryPolicy(attempts=40, backoff_s=0.1, max_backoff_s=1.0, max_retry_after_s=1.0)
    client = make_client(app.url, retry=patient)
    first = client.encode(fresh_images(1))
    [replica] = _encoder_replicas(app.name)
    ray.kill(replica, no_restart=True)  # Serve's controller starts a new replica
    images = fresh_images(2)
    handles = client.encode(images)  # retried through the restart, then answered
    assert [h.cached for h in handles] == [False, False]
    with EncoderClient(app.url) as check:
        assert check.probe([first[0].key, *(h.key for h in handles)]) != [None] * 3


# -- packaging ---------------------------------------------------------------------------------
def test_importing_the_client_loads_no_heavy_dependency() -> None:
    code = (
        "import sys, vitserve.client, vitserve.client.adapters, vitserve.client.ec_plan\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    assert {"httpx", "numpy", "msgpack", "blake3"} <= loaded
    assert not loaded & {
        "torch",
        "transformers",
        "ray",
        "redis",
        "PIL",
        "prometheus_client",
        "vllm",
    }


def test_the_client_installs_without_the_servers_dependencies() -> None:
    """The distribution's base requirements are the client's; the service's are an extra."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("vitserve") or []]
    base = {r.name for r in reqs if r.marker is None}
    server = {r.name for r in reqs if r.marker and r.marker.evaluate({"extra": "server"})}
    assert base == {"httpx", "numpy", "msgpack", "blake3"}
    assert {"ray", "torch", "transformers", "redis", "pillow", "fastapi"} <= server


def test_the_rows_route_answers_several_reads_in_one_body(redis_app, redis_url) -> None:
    """``POST /v1/rows`` (the HTTP fetch path of a client without a direct store)."""
    import httpx

    from vitserve.cache.codec import decode_record, unpack_records

    with EncoderClient(redis_app.url) as client:
        [handle] = client.encode(fresh_images(1))
    absent = "0" * 64
    answer = httpx.post(
        f"{redis_app.url}/v1/rows", json={"reads": [[handle.key, 1, 3], [absent, 0, 1]]}
    )
    assert answer.status_code == 200, answer.text
    present, missing = unpack_records(answer.content)
    assert missing is None and decode_record(present, key=handle.key).num_tokens == 2
    for bad, status in [
        ({"reads": [["nothex", 0, 1]]}, 422),
        ({"reads": [[handle.key, 5, 2]]}, 422),
        ({"reads": [[handle.key, 0, 1]] * 1025}, 413),
    ]:
        assert httpx.post(f"{redis_app.url}/v1/rows", json=bad).status_code == status
