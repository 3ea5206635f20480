"""The store conformance suite (tests/cache/test_conformance.py) again, for the store kind this
folder's multi-node Ray cluster changes: node-local stores, their actors and claims on the
cluster's nodes (the cross-node contract itself: test_multinode.py). The other kinds (in-process,
Redis, tiered over Redis, Redis Cluster) never touch Ray: `make test` runs them.
"""

from collections.abc import Callable, Iterator

import pytest

from tests.cache.conftest import STORE_KINDS, store_maker
from tests.cache.test_conformance import *  # noqa: F403 - the suite, collected here
from tests.conftest import STORE_KIND_NEEDS

# The kinds whose stores live in Ray (today: node)
MULTINODE_KINDS = tuple(kind for kind in STORE_KINDS if "ray" in STORE_KIND_NEEDS[kind])


@pytest.fixture(params=MULTINODE_KINDS)
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable]:
    yield from store_maker(request)
