"""The vitserve application on a real Ray Serve instance, over real HTTP.

Batching, single flight (one replica and two), the encode/probe/fetch API, bad requests, the
429 and 503 paths, and the /metrics route. Outputs are compared with the in-process engine.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import itertools
import time
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image

from tests.image_inputs import bad_images, crafted_png
from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart
from vitserve.keys import content_key
from vitserve.testing.images import make_image

pytestmark = pytest.mark.cpu_profile  # CI runs it again as on each CPU profile

_seeds = itertools.count(10_000)


def fresh(width: int, height: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """An image no earlier test has sent (a new seed each call)."""
    return make_image(width, height, fmt=fmt, mode=mode, seed=next(_seeds))


def concurrently(fn, args: list) -> list:
    with cf.ThreadPoolExecutor(len(args)) as pool:
        return list(pool.map(fn, args))


def delta(after: dict, before: dict, name: str) -> int:
    return after[name] - before[name]


# -- 1. batching ------------------------------------------------------------------------------
def test_concurrent_mixed_resolution_requests_are_batched_and_equal_the_engine(
    main_app, engines
) -> None:
    from vitserve.cache.codec import decode_record

    sizes = [
        (448, 448),
        (320, 240),
        (448, 448),
        (640, 480),
        (320, 240),
        (448, 448),
        (640, 480),
        (200, 120),
        (448, 448),
        (320, 240),
        (200, 120),
        (640, 480),
    ]
    images = [fresh(w, h, fmt="JPEG" if i % 2 else "PNG") for i, (w, h) in enumerate(sizes)]
    before = main_app.counters()
    # twelve clients, one image each, at once
    responses = concurrently(lambda b: main_app.encode([b]), images)
    after = main_app.counters()

    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    items = [r.json()["items"][0] for r in responses]
    forwards = delta(after, before, "forward_calls")
    assert delta(after, before, "images") == len(images)
    assert forwards < len(images), f"{forwards} forwards for {len(images)} images"
    new_forwards = after["recent_forwards"][len(before["recent_forwards"]) :]
    assert len(new_forwards) == forwards
    for f in new_forwards:  # every forward ran one bucket only
        assert f["item_buckets"] == [f["bucket"]], f
        assert f["padded_tokens"] == 0
    assert sum(f["images"] for f in new_forwards) == len(images)
    assert any(f["images"] > 1 for f in new_forwards)

    engine = engines["qwen2_vl"]
    health = main_app.client.get(f"{main_app.url}/healthz").json()
    assert health["fingerprint"] == engine.fingerprint
    assert health["max_batch_patches"] == main_app.config.batching.max_batch_patches
    expected = engine.encode(images)
    worst = 0.0
    for item, image, want in zip(items, images, expected, strict=True):
        assert item["key"] == content_key(image, engine.fingerprint, main_app.config.namespace)
        assert item["num_tokens"] == want.num_tokens
        assert item["grid"] == list(want.grid)
        assert item["shape"] == list(want.tensor.shape) and item["dtype"] == "fp32"
        body = main_app.client.get(f"{main_app.url}/v1/embeddings/{item['key']}")
        assert body.status_code == 200
        assert body.headers["content-type"] == "application/octet-stream"
        got = decode_record(body.content, key=item["key"]).embedding
        worst = max(worst, ulps_apart(torch.from_numpy(got), want.tensor))
    # The service batched these differently from the in-process call: the engine's promise.
    print(f"\nservice vs in-process engine: {worst:.3g} ulps")
    assert worst <= BATCH_TOLERANCE_ULPS["fp32"]


def test_a_request_of_many_images_is_batched_and_answers_in_input_order(main_app, engines) -> None:
    images = [fresh(448, 448), fresh(200, 120), fresh(448, 448), fresh(640, 480)]
    images.append(images[1])  # the same bytes twice: one key, encoded once
    before = main_app.counters()
    response = main_app.encode(images)
    after = main_app.counters()
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    assert delta(after, before, "images") == 4
    assert delta(after, before, "forward_calls") < 4
    assert items[4]["key"] == items[1]["key"] and items[4]["num_tokens"] == items[1]["num_tokens"]
    engine = engines["qwen2_vl"]
    expected = engine.prepare(images)
    ns = main_app.config.namespace
    assert [i["key"] for i in items] == [content_key(b, engine.fingerprint, ns) for b in images]
    assert [i["grid"] for i in items] == [list(p.grid) for p in expected]


def test_an_image_over_the_batch_cap_runs_alone_and_the_rest_still_batch(deploy) -> None:
    """A cap below one image's patches (as the CPU default is on an 8 MiB cache for a 448px
    image): that image is answered, alone; smaller ones still share a forward."""
    app = deploy("smallcap", batching={"max_batch_patches": 300, "batch_wait_timeout_s": 0.2})
    assert app.client.get(f"{app.url}/healthz").json()["max_batch_patches"] == 300
    big, small = fresh(448, 448), [fresh(200, 120), fresh(200, 120)]  # 484 and 112 patches
    before = app.counters()
    responses = concurrently(app.encode, [[big], [big, *small], [fresh(448, 448)]])
    after = app.counters()
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    items = [i for r in responses for i in r.json()["items"]]
    assert all("num_tokens" in i for i in items), items
    assert delta(after, before, "images") == 4  # the big image once (single flight)
    new_forwards = after["recent_forwards"][len(before["recent_forwards"]) :]
    assert sum(f["images"] for f in new_forwards) == 4
    for f in new_forwards:  # over the cap means alone
        assert f["tokens"] <= 300 or f["images"] == 1, f
    assert any(f["images"] == 2 for f in new_forwards)  # the two small ones together


# -- the API ----------------------------------------------------------------------------------
def test_json_items_key_only_items_probe_and_row_ranges(main_app) -> None:
    from vitserve.cache.codec import decode_record

    image = fresh(320, 240)
    first = main_app.encode([image]).json()["items"][0]
    assert first["cached"] is False
    key, unknown = first["key"], "ab" * 32

    doc = {"images": [{"data": base64.b64encode(image).decode()}, {"key": key}, {"key": unknown}]}
    before = main_app.counters()
    response = main_app.client.post(f"{main_app.url}/v1/encode", json=doc)
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    assert items[0]["cached"] is True and items[0]["key"] == key
    assert items[1]["cached"] is True and items[1]["num_tokens"] == first["num_tokens"]
    assert items[2]["error"]["type"] == "CacheMissError" and items[2]["error"]["status"] == 404
    assert main_app.counters()["images"] == before["images"]  # nothing re-encoded

    probe = main_app.client.post(f"{main_app.url}/v1/probe", json={"keys": [key, unknown]})
    assert probe.json() == {"exists": [True, False]}

    whole = decode_record(main_app.client.get(f"{main_app.url}/v1/embeddings/{key}").content)
    part = main_app.client.get(f"{main_app.url}/v1/embeddings/{key}", params={"start": 3, "end": 9})
    assert part.status_code == 200
    assert part.headers["x-vitserve-row-start"] == "3"
    assert part.headers["x-vitserve-num-tokens"] == str(first["num_tokens"])
    rows = decode_record(part.content)
    assert rows.num_tokens == 6
    np.testing.assert_array_equal(rows.embedding, whole.embedding[3:9])
    last4 = first["num_tokens"] - 4  # no end: to the last row
    tail = main_app.client.get(f"{main_app.url}/v1/embeddings/{key}", params={"start": last4})
    assert tail.headers["x-vitserve-row-start"] == str(last4)
    np.testing.assert_array_equal(decode_record(tail.content).embedding, whole.embedding[last4:])
    outside = main_app.client.get(
        f"{main_app.url}/v1/embeddings/{key}", params={"start": 5, "end": first["num_tokens"] + 1}
    )
    err = _error(outside, 422)
    assert err["type"] == "MalformedRequestError" and "outside" in err["message"]


def test_health_and_openapi(main_app) -> None:
    health = main_app.client.get(f"{main_app.url}/healthz").json()
    assert health["status"] == "ok" and health["family"] == "qwen2_vl"
    paths = main_app.client.get(f"{main_app.url}/openapi.json").json()["paths"]
    assert {"/v1/encode", "/v1/probe", "/v1/embeddings/{key}", "/healthz", "/metrics"} <= set(paths)
    assert main_app.client.get(f"{main_app.url}/docs").status_code == 200


# -- 2. single flight -------------------------------------------------------------------------
def test_sixteen_concurrent_requests_for_one_new_image_encode_it_once(main_app) -> None:
    image = fresh(640, 480)
    before = main_app.counters()
    responses = concurrently(main_app.encode, [[image]] * 16)
    after = main_app.counters()
    assert all(r.status_code == 200 for r in responses)
    items = [r.json()["items"][0] for r in responses]
    assert len({(i["key"], i["num_tokens"]) for i in items}) == 1
    assert delta(after, before, "images") == 1
    assert delta(after, before, "forward_calls") == 1


def test_single_flight_holds_across_two_encoder_replicas(deploy) -> None:
    """Two encoder replicas share the node store: one encodes, the other waits on its claim
    (two ingress replicas: a request joins an encode in flight on its own ingress, so the
    burst must come through both to meet at the encoders)."""
    app = deploy(
        "pair",
        encoder={"num_replicas": 2, "num_cpus": 0.2},
        ingress={"num_replicas": 2, "num_cpus": 0.05},
        batching={"batch_wait_timeout_s": 0.2},
    )

    def totals() -> tuple[float, float]:
        """Images encoded, and joined through the other replica's claim, over both encoder
        replicas: their own counts, which hold every encode whose request has answered."""
        both = app.encoder_counters(replicas=2).values()
        remote = sum(c["counts"].value("single_flight_joins_total", scope="remote") for c in both)
        return sum(c["images"] for c in both), remote

    for _ in range(3):  # until the router has sent some of the burst to each replica
        image = fresh(640, 480)
        encoded0, remote0 = totals()
        responses = concurrently(app.encode, [[image]] * 16)
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        assert len({r.json()["items"][0]["key"] for r in responses}) == 1
        now = totals()
        encoded, remote = now[0] - encoded0, now[1] - remote0
        assert encoded == 1, f"{encoded} encodes of one image across two replicas"
        if remote >= 1:
            return
    pytest.fail("no request ever waited on the other replica's claim")


# -- 3. bad requests --------------------------------------------------------------------------
def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_request_limits_answer_413_naming_the_limit(main_app) -> None:
    small = fresh(64, 64)
    err = _error(main_app.encode([small] * 9), 413)
    assert err["limit"] == "max_images_per_request" and err["value"] == 9 and err["allowed"] == 8

    noise = np.random.default_rng(0).integers(0, 255, (1100, 1100, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="BMP")  # 3.6 MB: over max_request_bytes (3 MiB)
    err = _error(main_app.encode([buf.getvalue()]), 413)
    assert err["limit"] == "max_request_bytes"

    buf = io.BytesIO()
    Image.fromarray(noise[:860, :860]).save(buf, format="BMP")  # 2.2 MB: one image over 2 MiB
    err = _error(main_app.encode([small, buf.getvalue()]), 413)
    assert (err["limit"], err["index"], err["allowed"]) == ("max_image_bytes", 1, 2 * 2**20)

    declared = crafted_png(5000, 5000, 8, zlib.compress(b"\0" * 64))
    err = _error(main_app.encode([small, declared]), 413)
    assert err["limit"] == "max_image_pixels" and "25000000" in err["message"]


def test_malformed_requests_answer_422_or_415_with_a_clear_message(main_app) -> None:
    post = main_app.client.post
    url = f"{main_app.url}/v1/encode"
    cases = {
        "invalid JSON": post(url, content=b"{nope", headers={"content-type": "application/json"}),
        "expected {": post(url, json={"pictures": []}),
        "not base64": post(url, json={"images": [{"data": "%%%"}]}),
        "not a 64-hex key": post(url, json={"images": [{"key": "xyz"}]}),
        "must be": post(url, json={"images": [{"data": "aGk=", "key": "ab" * 32}]}),
        "no images": post(url, json={"images": []}),
        "unknown multipart fields": post(url, files=[("image", ("a", b"x"))]),
    }
    for needle, response in cases.items():
        err = _error(response, 422)
        assert err["type"] == "MalformedRequestError" and needle in err["message"], (needle, err)
    err = _error(post(url, content=b"raw", headers={"content-type": "text/plain"}), 415)
    assert "unsupported content type" in err["message"]

    assert _error(post(f"{main_app.url}/v1/probe", json={"keys": ["zz"]}), 422)
    assert _error(main_app.client.get(f"{main_app.url}/v1/embeddings/nothex"), 422)
    missing = main_app.client.get(f"{main_app.url}/v1/embeddings/{'cd' * 32}")
    assert _error(missing, 404)["type"] == "CacheMissError"


def test_bad_images_fail_alone_and_the_replica_keeps_serving(main_app) -> None:
    bad = bad_images()
    good = fresh(320, 240)
    images = [bad["truncated-jpeg"], good, bad["text"], bad["empty"]]
    response = main_app.encode(images)
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    assert items[0]["error"]["type"] == "ImageDecodeError" and items[0]["error"]["index"] == 0
    assert "num_tokens" in items[1]
    assert items[2]["error"]["type"] == "ImageDecodeError" and items[2]["error"]["status"] == 422
    assert items[3]["error"]["index"] == 3
    # the bomb is refused up front, from its header
    err = _error(main_app.encode([good, bad["bomb"]]), 413)
    assert err["limit"] == "max_image_pixels"
    # and the same replica still serves
    after = main_app.encode([fresh(448, 448)])
    assert after.status_code == 200 and "num_tokens" in after.json()["items"][0]


@pytest.mark.parametrize("where", ["ingress", "deployment"])
def test_every_preprocessing_placement_gives_the_same_answers(deploy, main_app, where) -> None:
    """``preprocess_at`` moves work between processes, never changes an answer: the same
    embeddings as the default placement (the encoder's), bad images failing alone."""
    from vitserve.cache.codec import decode_record

    app = deploy(
        f"prep-{where}",
        preprocess_at=where,
        **{"encoder.num_cpus": 0.05, "preprocess.num_cpus": 0.05},
    )  # the cluster is full
    assert app.client.get(f"{app.url}/healthz").json()["preprocess_at"] == where
    images = [fresh(320, 240), bad_images()["truncated-jpeg"], fresh(96, 160)]
    ours, theirs = (a.encode(images).json()["items"] for a in (app, main_app))
    assert ours[1]["error"]["type"] == "ImageDecodeError" and ours[1]["error"]["index"] == 1
    for mine, ref in zip([ours[0], ours[2]], [theirs[0], theirs[2]], strict=True):
        assert mine["cached"] is False and mine["num_tokens"] == ref["num_tokens"]
        got, want = (
            decode_record(a.client.get(f"{a.url}/v1/embeddings/{i['key']}").content)
            for a, i in ((app, mine), (main_app, ref))
        )
        np.testing.assert_array_equal(got.embedding, want.embedding)  # same shapes, same run


def test_an_overloaded_encoder_answers_429_with_retry_after(deploy) -> None:
    """One request in flight and one queued: the next is refused at once (429), not queued
    until memory or a timeout gives out; the deployment keeps serving."""
    app = deploy(
        "tight",
        encoder={"max_ongoing_requests": 1, "max_queued_requests": 1},
        batching={"batch_wait_timeout_s": 2.0},
    )  # the first holds the slot ~2 s

    def timed(image: bytes) -> tuple[object, float]:
        started = time.monotonic()
        return app.encode([image]), time.monotonic() - started

    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(timed, fresh(320, 240))
        time.sleep(0.5)
        second = pool.submit(timed, fresh(320, 240))
        time.sleep(0.5)
        refused, refused_in = timed(fresh(320, 240))
        (held, held_for), (queued, _) = first.result(), second.result()
        assert held.status_code == 200 and queued.status_code == 200
    err = _error(refused, 429)
    assert err["type"] == "BackpressureError" and refused.headers["retry-after"] == "1"
    assert (err["queued"], err["limit"]) == (1, 1)
    # refused at once, not after waiting: well within the time the held request took
    assert refused_in < held_for / 2, (refused_in, held_for)
    ok = app.encode([fresh(320, 240)])
    assert ok.status_code == 200, ok.text


# -- store down -------------------------------------------------------------------------------
def test_a_store_that_is_down_gives_503_for_fetches_while_encodes_still_answer(
    deploy, spawn_redis
) -> None:
    server = spawn_redis()
    app = deploy("redisdown", store=f"{server.url}?timeout_s=0.5")
    image = fresh(320, 240)
    [stored] = app.encode([image]).json()["items"]
    key = stored["key"]
    assert "published" not in stored  # said only of what the store did not take
    assert app.client.get(f"{app.url}/v1/embeddings/{key}").status_code == 200

    server.kill()
    fetch = app.client.get(f"{app.url}/v1/embeddings/{key}")
    assert _error(fetch, 503)["type"] == "StoreUnavailableError"
    assert fetch.headers["retry-after"] == "1"
    probes = [
        app.client.post(f"{app.url}/v1/probe", json={"keys": [key]}),
        app.client.post(f"{app.url}/v1/probe", json={"keys": [key], "headers": True}),
    ]
    for answer in (fetch, *probes):
        assert _error(answer, 503)
        # no internal address in an answer: the store is named by kind, its host and port
        # replaced (the log keeps them): 'store redis <address>/0 unavailable ...'
        assert "<address>" in answer.text, answer.text
        assert "127.0.0.1" not in answer.text and str(server.port) not in answer.text
    again = app.encode([image, fresh(200, 120)])  # recomputed, not failed
    assert again.status_code == 200, again.text
    assert again.json()["items"][0]["key"] == key
    # ... and said not to be in the store: the SDK then tells a miss from a store that failed
    assert [item["published"] for item in again.json()["items"]] == [False, False], again.text
    # both failures counted where they happened, before the answer: the ingress's lookup and
    # the encoder's publish
    stats = app.stats()
    assert stats["ingress"]["counts"].value("store_errors_total", op="lookup_or_claim") >= 1
    assert stats["encoder"]["counts"].value("store_errors_total", op="put") >= 1


# -- 4. metrics -------------------------------------------------------------------------------
METRICS = [
    "vitserve_images_encoded_total",
    "vitserve_tower_forward_calls_total",
    "vitserve_encode_latency_seconds_count",
    "vitserve_stage_seconds_count",
    "vitserve_store_round_trip_seconds_count",
    "vitserve_batch_images_count",
    "vitserve_batch_patches_sum",
    "vitserve_padded_token_fraction_count",
    "vitserve_cache_hits_total",
    "vitserve_cache_misses_total",
    "vitserve_cache_evictions",
    "vitserve_single_flight_joins_total",
    "vitserve_bytes_published_total",
    "vitserve_bytes_fetched_total",
    "vitserve_requests_total",
]


STAGES = ("preprocess", "queue_wait", "forward", "publish")
STORE_OPS = ("lookup_or_claim", "put", "get")  # what encoding + fetching call


def test_stats_route_serves_the_replicas_own_counts_exact_at_once(main_app) -> None:
    """``GET /v1/stats``: what the ingress replica and an encoder replica counted, moved by a
    request as soon as it is answered (``/metrics`` waits for Ray's export)."""

    from vitserve.deployments.common.metrics import Counts

    def stats() -> dict:
        response = main_app.client.get(f"{main_app.url}/v1/stats")
        assert response.status_code == 200, response.text
        doc = response.json()
        for side in doc.values():
            side["counts"] = Counts.from_json(side["counts"])
        return doc

    def moved(a: dict, b: dict, side: str, name: str, **labels: str) -> float:
        return b[side]["counts"].value(name, **labels) - a[side]["counts"].value(name, **labels)

    before = stats()
    image = fresh(320, 240)
    assert main_app.encode([image]).status_code == 200
    after = stats()
    assert after["encoder"]["images"] - before["encoder"]["images"] == 1
    assert after["encoder"]["replica"] == main_app.counters()["replica"]
    assert moved(before, after, "encoder", "images_encoded_total") == 1
    assert moved(before, after, "ingress", "requests_total", route="encode", status="200") == 1
    assert main_app.encode([image]).status_code == 200  # a hit: counted, not encoded
    hit = stats()
    assert hit["encoder"]["images"] == after["encoder"]["images"]
    assert moved(after, hit, "ingress", "cache_hits_total") == 1


def test_metrics_route_exposes_the_service_metrics_and_they_move(main_app) -> None:
    warm = fresh(448, 448)
    concurrently(main_app.encode, [[warm]] * 3)  # some single-flight joins
    key = main_app.encode([warm]).json()["items"][0]["key"]
    main_app.client.get(f"{main_app.url}/v1/embeddings/{key}")
    main_app.wait_metric("vitserve_bytes_fetched_total", lambda v: v > 0)
    time.sleep(3)  # idle for longer than Ray keeps a gauge nobody refreshes (2 intervals)
    response = main_app.client.get(f"{main_app.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "ray_vitserve" not in response.text
    assert "# TYPE vitserve_images_encoded_total" in response.text
    names = {n for n, _, _ in main_app.samples()}
    assert set(METRICS) <= names, set(METRICS) - names

    # Ray exports each process's metrics apart, every second or later under load: read the
    # "before" values once the page has caught up with the encoder replica's own count
    def caught_up(page: Callable[..., float]) -> bool:
        return page(METRICS[0]) == main_app.counters()["images"]

    page = main_app.wait_page(caught_up)
    assert caught_up(page), "the metrics page lags the replica's count of images encoded"
    before = {n: page(n) for n in METRICS}
    stage_count = "vitserve_stage_seconds_count"
    store_count = "vitserve_store_round_trip_seconds_count"
    stages = {s: page(stage_count, stage=s) for s in STAGES}
    store_ops = {op: page(store_count, op=op) for op in STORE_OPS}
    images = [fresh(448, 448), fresh(320, 240), fresh(200, 120)]
    keys = [i["key"] for i in main_app.encode(images).json()["items"]]
    main_app.encode(images[:1])  # a cache hit
    for key in keys:
        main_app.client.get(f"{main_app.url}/v1/embeddings/{key}")
    moving = [
        n
        for n in METRICS
        if n not in ("vitserve_cache_evictions", "vitserve_single_flight_joins_total")
    ]

    def stuck(page: Callable[..., float]) -> list[str]:
        """What has not moved yet: every stage of a new image's path and every store call on
        it is timed."""
        return (
            [n for n in moving if page(n) <= before[n]]
            + [s for s, w in stages.items() if page(stage_count, stage=s) <= w]
            + [op for op, w in store_ops.items() if page(store_count, op=op) <= w]
        )

    def encoded(page: Callable[..., float]) -> float:
        return page(METRICS[0]) - before[METRICS[0]]

    # one /metrics fetch per poll for every value (a fetch takes ~1 s late in the suite)
    page = main_app.wait_page(lambda page: not stuck(page) and encoded(page) >= 3)
    assert not stuck(page), stuck(page)
    assert main_app.counters()["images"] - before[METRICS[0]] == 3  # the repeat was a hit
    assert encoded(page) == 3
    assert page("vitserve_requests_total", route="encode", status="200") > 0
