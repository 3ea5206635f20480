"""The store conformance suite (tests/cache/test_conformance.py, every store kind) again, its
node-local stores on this folder's multi-node Ray cluster (the cross-node contract itself:
test_multinode.py)."""

from tests.cache.conftest import make_store  # noqa: F401 - the suite's fixture, here
from tests.cache.test_conformance import *  # noqa: F403 - the suite, collected here
