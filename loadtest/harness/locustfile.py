"""The locust users of the harness's scenarios (closed loop: no wait between requests, so the
user count is the concurrency). Configured by the environment variable ``LOADTEST_CONF``, a JSON
object written by ``loadtest.harness.run``:

* ``scenario``: ``random`` / ``cache_off`` / ``step`` (``POST /v1/encode`` with K images,
  multipart) or ``agent`` (the client SDK, ``EncoderClient.encode`` of the whole conversation);
* ``k_min``, ``k_max``, ``duplicate_ratio``, ``turns``, ``seed``, ``run_id``;
* ``stages``: ``[[until_s, users], ...]`` for the step load (a ``LoadTestShape``).

Each request is reported under a name ending in ``k=<images>``, which the report reads.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import ClassVar

from locust import HttpUser, LoadTestShape, User, constant, task

from loadtest.harness.scenarios import AgentConversation, ImagePool, RandomMultimodal

CONF = json.loads(os.environ.get("LOADTEST_CONF", "{}"))
SCENARIO = CONF.get("scenario", "random")
POOL = ImagePool(per_size=2, seed=int(CONF.get("seed", 0)), run_id=CONF.get("run_id", "run"))
_user_seq = itertools.count()


def _generator() -> RandomMultimodal:
    dup = 0.0 if SCENARIO == "cache_off" else float(CONF.get("duplicate_ratio", 0.3))
    return RandomMultimodal(
        POOL,
        int(CONF.get("k_min", 1)),
        int(CONF.get("k_max", 4)),
        duplicate_ratio=dup,
        seed=int(CONF.get("seed", 0)),
    )


GENERATOR = _generator()  # one per process: the duplicate ratio holds across users


class EncodeUser(HttpUser):
    """``POST /v1/encode``, multipart, K images per request."""

    abstract = SCENARIO == "agent"
    wait_time = constant(0)

    @task
    def encode(self) -> None:
        req = GENERATOR.next_request()
        files = [("images", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(req.images)]
        with self.client.post(
            "/v1/encode",
            files=files,
            name=f"/v1/encode k={req.k}",
            catch_response=True,
            timeout=300,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            items = resp.json().get("items", [])
            bad = [it["error"] for it in items if "error" in it]
            if len(items) != req.k or bad:
                resp.failure(f"{len(items)} items for {req.k} images; errors: {bad[:2]}")


class AgentUser(User):
    """A multi-turn agent through the SDK: turn t encodes the conversation's t images (the SDK
    probes them by key and uploads only the new one)."""

    abstract = SCENARIO != "agent"
    wait_time = constant(0)

    def on_start(self) -> None:
        from vitserve.client import EncoderClient

        self.sdk = EncoderClient(self.host, timeout_s=300)
        self.conv = AgentConversation(
            POOL,
            turns=int(CONF.get("turns", 6)),
            seed=int(CONF.get("seed", 0)) * 100 + next(_user_seq),
        )

    def on_stop(self) -> None:
        self.sdk.close()

    @task
    def turn(self) -> None:
        req = self.conv.next_request()
        started = time.perf_counter()
        exc = None
        try:
            handles = self.sdk.encode(req.images)
            if len(handles) != req.k:
                raise RuntimeError(f"{len(handles)} handles for {req.k} images")
        except Exception as e:  # reported to locust as this request's failure
            exc = e
        self.environment.events.request.fire(
            request_type="SDK",
            name=f"sdk.encode k={req.k}",
            response_time=(time.perf_counter() - started) * 1000,
            response_length=0,
            exception=exc,
            context={},
        )


if CONF.get("stages"):

    class StepLoad(LoadTestShape):
        """low -> high -> low users, from ``stages``: ``[[until_s, users], ...]``."""

        stages: ClassVar = [(float(t), int(u)) for t, u in CONF["stages"]]

        def tick(self):
            now = self.get_run_time()
            for until, users in self.stages:
                if now < until:
                    return users, max(users, 1)
            return None
