"""The SDK's direct store when the caller hands it an open store, fast and without a service:
the SDK reads through a store over that store's connection that checks the service's
fingerprint (the caller's store is not changed), counting in the caller's store's counters;
a store that checks another model's records, or serves another namespace, is refused."""

from __future__ import annotations

import pytest

from vitserve.cache.memory import MemoryStore
from vitserve.client.core import ApiCall, ClientCore, Reply
from vitserve.errors import ConfigError
from vitserve.testing.records import make_record

FP, OTHER = "f" * 64, "e" * 64
MODEL = {"status": "ok", "fingerprint": FP, "namespace": "ns"}


def _described(store: MemoryStore, model: dict = MODEL) -> ClientCore:
    core = ClientCore(store=store)
    flow = core.describe()
    assert next(flow) == ApiCall("healthz")
    with pytest.raises(StopIteration):
        flow.send(Reply(200, model))
    return core


def test_a_given_store_is_read_under_the_services_fingerprint() -> None:
    given = MemoryStore(namespace="ns")
    core = _described(given)
    assert core.store is not given and given.fingerprint is None  # the caller's store as it was
    assert core.store.connection is given.connection and not core.store.owns_connection
    assert (core.store.namespace, core.store.fingerprint) == ("ns", FP)
    mine, theirs = make_record(4, 8, fingerprint=FP), make_record(4, 8, fingerprint=OTHER, seed=1)
    given.put_many([mine, theirs])
    assert core.store.get(mine.key) is not None
    assert core.store.get(theirs.key) is None  # another model's record: a miss here
    stats = given.stats()  # the SDK's reads count in the caller's store
    assert (stats["hits"], stats["integrity_misses"]) == (1, 1)


def test_a_given_store_of_the_same_model_is_used_as_it_is() -> None:
    given = MemoryStore(namespace="ns", fingerprint=FP)
    assert _described(given).store is given


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (lambda: MemoryStore(namespace="ns", fingerprint=OTHER), "records of the model"),
        (lambda: MemoryStore(namespace="other"), "namespace"),
    ],
)
@pytest.mark.parametrize("claims_at", [False, True], ids=["healthz-plain", "healthz-claims_at"])
def test_a_given_store_of_another_model_or_namespace_is_refused(given, message, claims_at) -> None:
    """Whether or not the service says where its claims live (every live one does): the
    checks of the namespace and the model run either way."""
    store = given()
    model = {**MODEL, "claims_at": store.connection.claim_scope} if claims_at else MODEL
    with pytest.raises(ConfigError, match=message):
        _described(store, model)
