"""Per-tenant quotas over HTTP, two tenants on one real vitserve application (real Serve, the
node store's actor of its own): a byte share of the store that the other tenant's writes cannot
evict (the store URL's ``share_bytes``), and a request rate over which a tenant is answered 429
naming the quota while the other is served.

The share is measured against the same run without shares: there, bob's writes evict alice's
entries; with them, none of alice's is evicted and each is a cache hit when encoded again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from vitserve.cache.node import NodeConnection
from vitserve.testing.images import make_image

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"
CAROL = "carol-token-aaaabbbbccccdddd"
ACTOR = "vitserve-test-shares"
SHARE_RECORDS = 4  # alice's share, in records
BUDGET_RECORDS = 10  # the store's budget, in records
BURST = 16  # each tenant's bucket; it refills at 0.2 a second
AUTH = {
    "tokens": [
        {"tenant": "alice", "token": ALICE},
        {"tenant": "bob", "token": BOB},
        {"tenant": "carol", "token": CAROL},
    ],
    "quota": {"requests_per_s": 0.2, "burst": BURST},
}


@pytest.fixture(scope="module")
def shared(deploy) -> Iterator[Any]:
    app = deploy(
        "shares",
        store=f"node://?actor_name={ACTOR}&max_bytes=64MiB&share_bytes=16MiB",
        auth=AUTH,
    )
    yield app
    deploy.remove(app.name)


_seed = iter(range(50_000, 60_000))


def _encode(app: Any, token: str, images: list[bytes]) -> list[dict[str, Any]]:
    files = [("images", (f"{i}.png", image, "image/png")) for i, image in enumerate(images)]
    r = app.client.post(
        f"{app.url}/v1/encode", headers={"authorization": f"Bearer {token}"}, files=files
    )
    assert r.status_code == 200, r.text
    return r.json()["items"]


def _held(app: Any, token: str, keys: list[str]) -> list[bool]:
    r = app.client.post(
        f"{app.url}/v1/probe", headers={"authorization": f"Bearer {token}"}, json={"keys": keys}
    )
    assert r.status_code == 200, r.text
    return r.json()["exists"]


def _images(n: int) -> list[bytes]:
    return [make_image(64, 48, seed=next(_seed)) for _ in range(n)]


def _configure(record_bytes: int, shares: bool) -> None:
    """The test's store actor: a budget of BUDGET_RECORDS records, each namespace's share
    SHARE_RECORDS records (or none), emptied (a smaller budget first evicts everything)."""
    for max_bytes in (1, BUDGET_RECORDS * record_bytes):
        NodeConnection(
            actor_name=ACTOR,
            max_bytes=max_bytes,
            share_bytes=SHARE_RECORDS * record_bytes if shares else None,
        ).close()


def _round(app: Any, record_bytes: int, shares: bool | None) -> tuple[int, int, int]:
    """alice encodes her share, bob writes twice the budget; then alice encodes hers again:
    (alice's entries still held, bob's held, alice's items answered cached). ``shares`` None:
    the store is configured already (its URL)."""
    if shares is not None:
        _configure(record_bytes, shares)
    images = _images(SHARE_RECORDS)
    keys = [item["key"] for item in _encode(app, ALICE, images)]
    assert _held(app, ALICE, keys) == [True] * SHARE_RECORDS
    bobs: list[str] = []
    for _ in range(4):  # 2 x the budget, in 4 requests
        bobs += [item["key"] for item in _encode(app, BOB, _images(BUDGET_RECORDS // 2))]
    kept = sum(_held(app, ALICE, keys))
    bob_held = sum(_held(app, BOB, bobs))
    cached = sum(item["cached"] for item in _encode(app, ALICE, images))
    return kept, bob_held, cached


def _record_bytes(app: Any) -> int:
    """The size of one record of the test's images (all 64x48: the same token count)."""
    first = _encode(app, ALICE, _images(1))[0]
    record = app.client.get(
        f"{app.url}/v1/embeddings/{first['key']}", headers={"authorization": f"Bearer {ALICE}"}
    )
    assert record.status_code == 200 and record.content
    return len(record.content)


def test_another_tenant_filling_the_store_does_not_evict_a_tenants_share(
    shared, reliability
) -> None:
    app = shared
    record_bytes = _record_bytes(app)
    without = _round(app, record_bytes, shares=False)
    with_shares = _round(app, record_bytes, shares=True)
    # without shares one LRU for all: bob's 2 x budget evicts every entry of alice's
    assert without[0] == 0, without
    # with them: each of alice's entries is kept (a hit when encoded again), bob evicted his own
    assert with_shares[0] == with_shares[2] == SHARE_RECORDS, with_shares
    assert with_shares[1] == BUDGET_RECORDS - SHARE_RECORDS, with_shares
    reliability.record(
        f"tenant store shares: B wrote 2x the store's budget ({2 * BUDGET_RECORDS} records) over "
        f"A's {SHARE_RECORDS}-record share: A kept {with_shares[0]} of {SHARE_RECORDS} "
        f"(without shares: {without[0]})",
        tried=2 * BUDGET_RECORDS + SHARE_RECORDS,
        failed=0,
        wrong=0,
        lost=SHARE_RECORDS - with_shares[0],
    )


def test_redis_keeps_the_shares_too(shared, deploy, redis_url, reliability) -> None:
    """The same over a Redis store whose URL gives the budget and the shares (vitserve's
    ledger in Redis): bob filling it keeps every entry of alice's share."""
    record_bytes = _record_bytes(shared)
    prefix = f"shares-{uuid.uuid4().hex[:8]}"
    url = (
        f"{redis_url}?prefix={prefix}&max_bytes={BUDGET_RECORDS * record_bytes}"
        f"&share_bytes={SHARE_RECORDS * record_bytes}"
    )
    app = deploy("shares-redis", store=url, auth=AUTH)
    try:
        kept, bob_held, cached = _round(app, record_bytes, shares=None)
    finally:
        deploy.remove(app.name)
    assert kept == cached == SHARE_RECORDS, (kept, bob_held, cached)
    assert bob_held == BUDGET_RECORDS - SHARE_RECORDS
    reliability.record(
        f"tenant store shares in Redis (vitserve's ledger): B wrote 2x the budget "
        f"({2 * BUDGET_RECORDS} records) over A's {SHARE_RECORDS}-record share: A kept {kept}",
        tried=2 * BUDGET_RECORDS + SHARE_RECORDS,
        failed=0,
        wrong=0,
        lost=SHARE_RECORDS - kept,
    )


def test_a_tenant_over_its_rate_is_answered_429_naming_it_and_the_others_are_not(
    shared, reliability
) -> None:
    app = shared
    headers = {"authorization": f"Bearer {CAROL}"}
    statuses, refusals = [], []
    for _ in range(BURST + 8):
        r = app.client.post(f"{app.url}/v1/probe", headers=headers, json={"keys": []})
        statuses.append(r.status_code)
        if r.status_code == 429:
            refusals.append(r)
    assert statuses[:BURST] == [200] * BURST, statuses
    assert len(refusals) >= 7, statuses  # a token may come back meanwhile (0.2 a second)
    for r in refusals:
        error = r.json()["error"]
        assert (error["type"], error["quota"], error["tenant"]) == (
            "QuotaExceededError",
            "requests_per_s",
            "carol",
        )
        assert int(r.headers["retry-after"]) >= 1
    # alice is served meanwhile
    ok = app.client.post(
        f"{app.url}/v1/probe", headers={"authorization": f"Bearer {ALICE}"}, json={"keys": []}
    )
    assert ok.status_code == 200, ok.text
    reliability.record(
        f"tenant request rate: C sent {len(statuses)} requests at once with a burst of {BURST}: "
        f"{len(refusals)} answered 429 naming requests_per_s, A served meanwhile",
        tried=len(statuses) + 1,
        failed=0,
        wrong=0,
        lost=0,
    )
