"""The per-tenant request rate (vitserve.deployments.common.quota) and its place in the Gate."""

from __future__ import annotations

import pytest

from vitserve.deployments.common.auth import Gate
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.common.quota import RateLimiter
from vitserve.errors import ConfigError, QuotaExceededError

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_burst_then_refuses_naming_the_quota_and_when_to_retry() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=2.0, capacity=3, clock=clock)
    for _ in range(3):
        limiter.take("alice")
    with pytest.raises(QuotaExceededError) as exc:
        limiter.take("alice")
    err = exc.value
    assert (err.quota, err.tenant, err.limit, err.http_status) == (
        "requests_per_s",
        "alice",
        2,
        429,
    )
    assert err.retry_after_s == pytest.approx(0.5) and err.retryable
    assert "requests_per_s" in str(err) and "alice" in str(err)
    assert limiter.refused == 1


def test_the_bucket_refills_at_the_rate_and_never_past_its_capacity() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=2.0, capacity=3, clock=clock)
    for _ in range(3):
        limiter.take("alice")
    clock.now += 0.5  # one token back
    limiter.take("alice")
    with pytest.raises(QuotaExceededError):
        limiter.take("alice")
    clock.now += 3600  # an hour idle: still only `capacity` at once
    for _ in range(3):
        limiter.take("alice")
    with pytest.raises(QuotaExceededError):
        limiter.take("alice")


def test_a_refused_request_takes_nothing() -> None:
    """Hammering while refused does not push the next allowed request further away."""
    clock = Clock()
    limiter = RateLimiter(rate=1.0, capacity=1, clock=clock)
    limiter.take("alice")
    for _ in range(50):
        with pytest.raises(QuotaExceededError):
            limiter.take("alice")
    clock.now += 1.0
    limiter.take("alice")


def test_one_tenant_over_its_rate_leaves_the_others_alone() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1.0, capacity=2, clock=clock)
    limiter.take("alice")
    limiter.take("alice")
    with pytest.raises(QuotaExceededError):
        limiter.take("alice")
    limiter.take("bob")
    limiter.take("bob")


def test_the_gate_charges_authenticated_tenants_only() -> None:
    """Unknown tokens are refused 401 before any bucket is made (so callers cannot grow the
    buckets), and each tenant's requests count against its own."""
    cfg = VitserveConfig.load(
        {
            "auth.tokens": [{"tenant": "alice", "token": ALICE}, {"tenant": "bob", "token": BOB}],
            "auth.quota": {"requests_per_s": 0.001, "burst": 2},
        }
    )
    gate = Gate(cfg)
    assert gate.tenant(ALICE).name == "alice"
    assert gate.tenant(ALICE).name == "alice"
    with pytest.raises(QuotaExceededError, match="alice"):
        gate.tenant(ALICE)
    assert gate.tenant(BOB).name == "bob"
    for _ in range(20):
        with pytest.raises(Exception, match="not valid"):
            gate.tenant("unknown-token-0123456789")
    assert gate.rate is not None and set(gate.rate._buckets) == {"alice", "bob"}


def test_a_rate_quota_without_tenants_is_a_config_error() -> None:
    cfg = VitserveConfig.load({"auth.quota.requests_per_s": 5})
    with pytest.raises(ConfigError, match="needs auth's tenants"):
        Gate(cfg)


def test_the_fronts_get_no_tenant_with_auth_off_and_a_charged_one_with_it_on() -> None:
    assert Gate(VitserveConfig.load({})).caller(None) is None
    cfg = VitserveConfig.load(
        {
            "auth.tokens": [{"tenant": "alice", "token": ALICE}],
            "auth.quota": {"requests_per_s": 0.001, "burst": 1},
        }
    )
    gate = Gate(cfg)
    caller = gate.caller(ALICE)
    assert caller is not None and caller.name == "alice"
    with pytest.raises(QuotaExceededError):
        gate.caller(ALICE)
