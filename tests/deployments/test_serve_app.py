"""``serve_app``: a deploy returns once its application runs and answers, and a deploy that
fails raises naming Serve's reason (real Ray Serve, the session's cluster)."""

from __future__ import annotations

import httpx
import pytest


def test_a_deploy_returns_when_its_application_answers(serve_url: str) -> None:
    from ray import serve

    from vitserve.deployments.runner.local import serve_app

    @serve.deployment(ray_actor_options={"num_cpus": 0.01})
    class Ok:
        async def __call__(self, request: object) -> str:
            return "ok"

    serve_app(Ok.bind(), name="t-ok", route_prefix="/t-ok")
    try:
        assert serve.status().applications["t-ok"].status == "RUNNING"
        reply = httpx.get(f"{serve_url}/t-ok", timeout=30)  # no wait: routed already
        assert reply.status_code == 200 and reply.text == "ok"
    finally:
        serve.delete("t-ok")


def test_a_deploy_that_fails_raises_naming_serves_reason(serve_url: str) -> None:
    from ray import serve

    from vitserve.deployments.runner.local import serve_app

    @serve.deployment(ray_actor_options={"num_cpus": 0.01}, max_constructor_retry_count=1)
    class Broken:
        def __init__(self) -> None:
            raise ValueError("broken on purpose")

    try:
        with pytest.raises(
            RuntimeError, match=r"(?s)Deploying application t-broken failed.*broken on purpose"
        ):
            serve_app(Broken.bind(), name="t-broken", route_prefix="/t-broken")
    finally:
        serve.delete("t-broken")
