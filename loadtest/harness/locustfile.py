"""The locust users of the harness's closed-loop scenarios (no wait between requests, so the user
count is the concurrency). Configured by the environment variable ``LOADTEST_CONF``, a JSON
object written by ``loadtest.harness.run``:

* ``scenario``: ``random`` / ``cache_off`` / ``step`` (``POST /v1/encode`` with K images,
  multipart), ``agent`` (the client SDK, ``EncoderClient.encode`` of the whole conversation) or
  ``chat`` (a streamed OpenAI chat completion with the conversation's images at ``chat_url``,
  see ``chat.py``);
* ``k_min``, ``k_max``, ``duplicate_ratio``, ``turns``, ``seed``, ``run_id``; for chat
  ``chat_url``, ``chat_model``, ``chat_max_tokens``;
* ``stages``: ``[[until_s, users], ...]`` (one stage for a constant load; low -> high -> low for
  the step load) and ``length``: ``[min_s, min_requests, max_s]``, when the point ends
  (:class:`loadtest.harness.load.RunLength`). One ``LoadTestShape`` runs both.
* ``records``: the JSON-lines file every request's
  :class:`~loadtest.harness.measures.Record` is appended to (the report's source).

Each request is reported under a name ending in ``k=<images>``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any, ClassVar

from locust import HttpUser, LoadTestShape, User, constant, events, task

from loadtest.harness.load import RunLength, closed_loop_tick
from loadtest.harness.measures import Record
from loadtest.harness.scenarios import (
    CHAT_SIZES,
    SIZES,
    AgentConversation,
    ChatConversation,
    ImagePool,
    RandomMultimodal,
    encode_error,
    encode_files,
)

CONF = json.loads(os.environ.get("LOADTEST_CONF", "{}"))
SCENARIO = CONF.get("scenario", "random")
POOL = ImagePool(
    sizes=CHAT_SIZES if SCENARIO == "chat" else SIZES,
    per_size=2,
    seed=int(CONF.get("seed", 0)),
    run_id=CONF.get("run_id", "run"),
)
_user_seq = itertools.count()
_RECORDS = open(CONF["records"], "a") if CONF.get("records") else None  # noqa: SIM115
_counted: dict[str, Any] = {"requests": 0, "first": None}  # count, first request's start


@events.request.add_listener
def _record(
    request_type: str,
    name: str,
    response_time: float,
    response_length: int,
    exception: Any = None,
    context: Any = None,
    start_time: float | None = None,
    **_: Any,
) -> None:
    """Every request, as one record (the report reads these, not locust's rounded CSV)."""
    latency = response_time / 1000
    started = start_time if start_time is not None else time.time() - latency
    _counted["requests"] += 1
    if _counted["first"] is None or started < _counted["first"]:
        _counted["first"] = started
    if _RECORDS is None:
        return
    k = int(name.rsplit("k=", 1)[1]) if "k=" in name else 0
    rec = Record(
        start=started,
        latency_s=latency,
        ok=exception is None,
        k=k,
        name=name,
        ttft_s=(context or {}).get("ttft_s"),
        error=None if exception is None else str(exception)[:200],
    )
    _RECORDS.write(rec.to_json() + "\n")
    _RECORDS.flush()


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

    abstract = SCENARIO in ("agent", "chat")
    wait_time = constant(0)

    @task
    def encode(self) -> None:
        req = GENERATOR.next_request()
        with self.client.post(
            "/v1/encode",
            files=encode_files(req),
            name=f"/v1/encode k={req.k}",
            catch_response=True,
            timeout=300,
        ) as resp:
            try:
                payload = resp.json()
            except ValueError:
                payload = None
            error = encode_error(resp.status_code, resp.text or "", payload, req.k)
            if error:
                resp.failure(error)


def _fire(user: User, kind: str, name: str, started: float, wall: float, **kw: Any) -> None:
    """Report a request made outside locust's HTTP client."""
    user.environment.events.request.fire(
        request_type=kind,
        name=name,
        response_time=(time.perf_counter() - started) * 1000,
        response_length=0,
        start_time=wall,
        **kw,
    )


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
        wall, started = time.time(), time.perf_counter()
        exc = None
        try:
            handles = self.sdk.encode(req.images)
            if len(handles) != req.k:
                raise RuntimeError(f"{len(handles)} handles for {req.k} images")
        except Exception as e:  # reported to locust as this request's failure
            exc = e
        _fire(self, "SDK", f"sdk.encode k={req.k}", started, wall, exception=exc, context={})


class ChatUser(User):
    """A chat with images at ``chat_url`` (any OpenAI-compatible server): turn t re-sends the
    conversation's t-1 images and one new one, streamed; TTFT rides in the record."""

    abstract = SCENARIO != "chat"
    wait_time = constant(0)

    def on_start(self) -> None:
        import httpx

        self.http = httpx.Client(timeout=300)
        self.url = CONF.get("chat_url") or f"{self.host}/prefill"
        self.conv = ChatConversation(
            POOL,
            turns=int(CONF.get("turns", 4)),
            seed=int(CONF.get("seed", 0)) * 100 + next(_user_seq),
            model=CONF.get("chat_model"),
            max_tokens=int(CONF.get("chat_max_tokens", 8)),
        )

    def on_stop(self) -> None:
        self.http.close()

    @task
    def turn(self) -> None:
        from loadtest.harness.chat import chat_turn

        req = self.conv.next_request()
        wall, started = time.time(), time.perf_counter()
        result = chat_turn(self.http, self.url, req.body)
        _fire(
            self,
            "CHAT",
            f"chat turn={req.turn} k={req.k}",
            started,
            wall,
            exception=RuntimeError(result.error) if result.error else None,
            context={"ttft_s": result.ttft_s},
        )


class PointShape(LoadTestShape):
    """The point's users over time (``stages``) until its length is done (``length``)."""

    stages: ClassVar = [(float(t), int(u)) for t, u in CONF.get("stages") or [[1e9, 1]]]
    length: ClassVar = RunLength(*CONF.get("length", [10, 0, 10]))

    def tick(self) -> tuple[int, float] | None:
        # the length counts from the first request's start (the window the report measures),
        # not from the shape's start: users take a moment to send their first requests
        first = _counted["first"]
        window_s = None if first is None else time.time() - first
        return closed_loop_tick(
            self.stages, self.length, self.get_run_time(), _counted["requests"], window_s
        )
