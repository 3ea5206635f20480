"""Session-wide fixtures: offline mode and the tiny random-weight models of every family."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a tiny random-weight full VLM saved with save_pretrained."""
    from vitserve.encoder.testmodels import FAMILIES, make_model

    root = tmp_path_factory.mktemp("models")
    return {family: make_model(family, "tiny", root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def engines(tiny_models: dict[str, Path]):
    """family -> fp32 CPU EncoderEngine over the tiny model (shared; read counters as deltas)."""
    from vitserve.encoder.engine import EncoderEngine

    return {
        f: EncoderEngine.from_pretrained(str(p), device="cpu", dtype="fp32")
        for f, p in tiny_models.items()
    }


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (starting one takes 5-8 s)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="vitserve-tests",
                 logging_level="warning")  # fmt: skip
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The suite's Redis (127.0.0.1:6379, db 15, which the suite may flush)."""
    import redis

    url = os.environ.get("VITSERVE_TEST_REDIS", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"the test suite needs a Redis at {url} (.ci/run starts one): {exc}")
    client.flushdb()
    client.close()
    return url
