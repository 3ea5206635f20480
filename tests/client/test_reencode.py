"""The SDK's read of an entry gone from the store, without a service or a store: it encodes
the image again from its handle and reads again; what is still missing then is a miss
(``CacheMissError``, not retryable) unless the service said it could not store it (its answer's
``published: false``, the store unavailable at its publish): then a retryable
``StoreUnavailableError``, as a failover of the store's primary gives while it lasts."""

from __future__ import annotations

from typing import Any

import pytest

from vitserve.client.core import ApiCall, ClientCore, Reply
from vitserve.client.handles import ImageHandle
from vitserve.errors import CacheMissError, StoreUnavailableError

MODEL = {"status": "ok", "fingerprint": "f" * 64, "namespace": "ns", "row_bytes": 32}
KEY = "a" * 64


def _item(**extra: Any) -> dict[str, Any]:
    return {
        "key": KEY,
        "num_tokens": 4,
        "grid": [1, 4, 4],
        "dtype": "fp32",
        "shape": [4, 8],
        "extras": [],
        "cached": False,
        **extra,
    }


def _fetch_of_a_gone_entry(encoded: dict[str, Any]) -> tuple[list[str], BaseException]:
    """Drive ``fetch`` of a handle whose entry the service's rows route never finds, the
    re-encode answered with ``encoded``: the routes called, and what the fetch raised."""
    core = ClientCore()
    handle = ImageHandle.from_item(_item(), source=b"image bytes", uploaded=True)
    flow = core.fetch([handle])
    routes, op = [], next(flow)
    try:
        while True:
            assert isinstance(op, ApiCall), op
            routes.append(op.route)
            if op.route == "healthz":
                op = flow.send(Reply(200, MODEL))
            elif op.route == "rows":
                op = flow.send([Reply(404, {}) for _ in op.payload])
            else:
                assert op.route == "encode" and op.payload["images"] == [b"image bytes"]
                op = flow.send(Reply(200, {"items": [encoded]}))
    except StopIteration:
        pytest.fail("the fetch of an entry never stored returned")
    except Exception as exc:
        return routes, exc


def test_an_entry_the_service_could_not_store_again_is_a_retryable_store_failure() -> None:
    routes, raised = _fetch_of_a_gone_entry(_item(published=False))
    assert routes == ["healthz", "rows", "encode", "rows"]
    assert isinstance(raised, StoreUnavailableError) and raised.retryable, raised
    assert KEY[:16] in str(raised)


def test_an_entry_stored_again_and_gone_at_once_is_a_miss() -> None:
    routes, raised = _fetch_of_a_gone_entry(_item())
    assert routes == ["healthz", "rows", "encode", "rows"]
    assert isinstance(raised, CacheMissError) and not raised.retryable
    assert raised.keys == [KEY]


def test_the_handle_says_whether_the_service_stored_the_record() -> None:
    assert ImageHandle.from_item(_item()).published
    assert not ImageHandle.from_item(_item(published=False)).published
