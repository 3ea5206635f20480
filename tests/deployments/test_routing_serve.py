"""vitserve's encoder router in a real Serve application (two encoder replicas, real HTTP): each
image goes to its key's replica while the pool is idle, a thumbnail does not queue behind a
large image on its key's replica, and a burst past the replicas' room waits in the router (for
up to ``encoder.routing_hold_s``) instead of being refused; with no hold, or with
``encoder.routing: serve-default``, the same burst is refused in part (429). The policy itself
is tested as plain bookkeeping in test_routing.py."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import App
from vitserve.deployments.encoder.admission import image_work
from vitserve.deployments.encoder.routing import rendezvous_rank
from vitserve.encoder.images import ImageLimits
from vitserve.keys import content_key
from vitserve.testing.images import make_image

_seeds = itertools.count(9_300_000)
REPLICAS = 2


def image(side: int = 64) -> bytes:
    return make_image(side, side, seed=next(_seeds))


def counters(app: App) -> dict[str, dict[str, Any]]:
    """Each encoder replica's counters by its id (the id the router ranks keys against)."""
    return app.encoder_counters(REPLICAS)


def owner(app: App, data: bytes, replicas: list[str]) -> str:
    fingerprint = app.encoder().describe.remote().result()["fingerprint"]
    key = content_key(data, fingerprint, app.config.namespace)
    return max(replicas, key=lambda r: rendezvous_rank(key, r))


def images_by_replica(app: App) -> dict[str, int]:
    return {r: c["images"] for r, c in counters(app).items()}


def post(app: App, images: list[bytes], timeout: float = 120) -> httpx.Response:
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]
    return httpx.post(f"{app.url}/v1/encode", files=files, timeout=timeout)


@pytest.fixture(scope="module")
def app(deploy) -> App:
    return deploy(
        "routed",
        encoder={"num_replicas": REPLICAS, "num_cpus": 0.2, "routing": "work"},
        **{"batching.batch_wait_timeout_s": 1.0},  # an image waits 1 s in its replica's queue
    )


def test_each_new_image_goes_to_its_keys_replica_while_the_pool_is_idle(app: App) -> None:
    before = images_by_replica(app)
    replicas = sorted(before)
    images = [image() for _ in range(8)]
    expected = dict.fromkeys(replicas, 0)
    for data in images:  # one at a time: the pool is idle for each
        expected[owner(app, data, replicas)] += 1
        assert post(app, [data]).status_code == 200
    after = images_by_replica(app)
    assert {r: after[r] - before[r] for r in replicas} == expected
    assert all(expected.values()), expected  # the keys spread over both replicas


def test_a_thumbnail_does_not_wait_behind_a_large_image_on_its_keys_replica(app: App) -> None:
    replicas = sorted(counters(app))
    big = image(448)
    loaded = owner(app, big, replicas)
    thumb = next(d for d in (image(32) for _ in range(100)) if owner(app, d, replicas) == loaded)
    before = images_by_replica(app)
    sent = threading.Thread(target=post, args=(app, [big]))
    sent.start()  # the large image waits 1 s in its replica's queue (the batch wait)
    try:
        deadline = time.monotonic() + 30
        while counters(app)[loaded]["admitted"]["patches"] == 0:  # admitted, not yet run
            assert time.monotonic() < deadline, "the large image never reached its replica"
        assert post(app, [thumb]).status_code == 200
    finally:
        sent.join(timeout=120)
    after = images_by_replica(app)
    other = next(r for r in replicas if r != loaded)
    assert after[other] - before[other] == 1  # the thumbnail, on the idle replica
    assert after[loaded] - before[loaded] == 1  # the large image, on its key's replica


def burst(app: App, n: int, side: int) -> list[int]:
    statuses: list[int] = []

    def send() -> None:
        statuses.append(post(app, [image(side)]).status_code)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    return statuses


@pytest.mark.parametrize(
    ("routing", "hold_s"), [("work", 120.0), ("work", 0.0), ("serve-default", None)]
)
def test_a_burst_past_the_replicas_room_waits_in_the_router_for_its_hold(
    app: App, deploy, routing: str, hold_s: float | None
) -> None:
    side = 96
    terms = app.encoder().work_terms.remote().result()  # the same model's resize rule
    patches = image_work(terms.rule, image(side), 0, ImageLimits()).patches
    # each replica admits 3 such images at once; the work router fills it to half of that
    encoder = {"num_replicas": REPLICAS, "num_cpus": 0.2, "routing": routing}
    if hold_s is not None:
        encoder["routing_hold_s"] = hold_s
    small = deploy(
        f"room-{routing}-{hold_s}".replace(".", "-"),
        encoder=encoder,
        **{"admission.max_patches": 3 * patches, "batching.batch_wait_timeout_s": 0.5},
    )
    statuses = burst(small, 16, side)
    deploy.remove(small.name)
    assert len(statuses) == 16
    if hold_s:  # every call waits in the router until a replica has room
        assert statuses == [200] * 16, statuses
    else:  # sent at once past the admission (Serve's router, or no hold): refused, retryable
        assert set(statuses) == {200, 429} and statuses.count(429) >= 4, statuses
