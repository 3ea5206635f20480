"""Per-tenant request rate: a token bucket per tenant, in each ingress replica.

A tenant may send ``auth.quota.requests_per_s`` requests a second on average and
``auth.quota.bucket`` at once; over that its request is refused with
:class:`~vitserve.errors.QuotaExceededError` (429, the quota named, ``Retry-After`` the time
until its next token) before any work is done, and other tenants' buckets are untouched. A
tenant's byte share of the store is the store's business (its URL's ``share_bytes``:
:class:`~vitserve.cache.lru.ByteBudgetLru`'s shares), not this module's.

Invariants:

* A bucket never holds more than ``bucket`` tokens nor fewer than zero; a refused request
  takes none.
* Buckets exist only for authenticated tenants (names from the tokens in force), so their
  number is bounded by the configured tenants, not by what callers send.
* Single-threaded: called on the replica's event loop; ``clock`` is injected for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from vitserve.errors import QuotaExceededError


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Token buckets by tenant name: ``rate`` tokens a second, at most ``capacity``."""

    def __init__(
        self, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or capacity < 1:
            raise ValueError(f"rate must be > 0 and capacity >= 1, got {rate}, {capacity}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._buckets: dict[str | None, _Bucket] = {}
        self.refused = 0

    def take(self, tenant: str | None) -> None:
        """One request of ``tenant``: a token taken, or QuotaExceededError (none taken)."""
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(self.capacity), now)
        bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return
        self.refused += 1
        raise QuotaExceededError(
            "requests_per_s", tenant, self.rate, retry_after_s=(1 - bucket.tokens) / self.rate
        )


__all__ = ["RateLimiter"]
