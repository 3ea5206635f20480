"""A chat turn against an OpenAI-compatible server (httpx over a mock transport, no server):
the route it posts to under any base URL, the body, TTFT from the stream, failures."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx

from loadtest.harness.chat import chat_turn, read_stream, served_model
from loadtest.harness.scenarios import ChatConversation, ImagePool


def sse(*events: dict | str) -> list[str]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}" for e in events]


def chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def ticking(*times: float) -> Iterator[float]:
    return iter(times)


STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}),
    chunk({}, "length"),
    {"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 2}},
    "[DONE]",
)


def test_ttft_is_the_first_token_not_the_role_chunk() -> None:
    clock = ticking(1.25, 3.0)  # first token, end
    result = read_stream(STREAM, lambda: next(clock), started=1.0)
    assert result.error is None
    assert result.ttft_s == 0.25 and result.latency_s == 2.0
    assert result.text == "Hello"
    assert result.usage["prompt_tokens"] == 300


def test_broken_streams_fail() -> None:
    def read(lines: list[str]) -> str | None:
        return read_stream(lines, lambda: 1.0, 0.0).error

    assert read(STREAM[:-1]) == "stream ended without [DONE]"
    assert read(sse(chunk({"role": "assistant"}), "[DONE]")) == "stream had no token"
    assert "error event" in (read(sse({"error": {"message": "oops"}})) or "")


def openai_server(seen: list[dict]) -> httpx.MockTransport:
    """An OpenAI-compatible server under the base path ``/base``."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/base/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "qwen-demo"}]})
        if request.url.path != "/base/v1/chat/completions":
            return httpx.Response(404, text="no route")
        body = json.loads(request.content)
        seen.append(body)
        if body.get("model") != "qwen-demo":
            return httpx.Response(400, json={"error": {"message": "unknown model"}})
        return httpx.Response(200, text="\n\n".join(STREAM) + "\n\n")

    return httpx.MockTransport(answer)


def test_a_conversation_against_any_openai_compatible_url() -> None:
    seen: list[dict] = []
    client = httpx.Client(transport=openai_server(seen))
    url = "http://llm:8001/base/"  # a base URL, trailing slash or not
    model = served_model(url, client)
    assert model == "qwen-demo"
    pool = ImagePool(sizes=((32, 32),), per_size=1, seed=0, run_id="t")
    conv = ChatConversation(pool, turns=3, seed=1, model=model)
    for turn in (1, 2, 3, 1):
        req = conv.next_request()
        assert (req.turn, req.k) == (turn, turn)
        result = chat_turn(client, url, req.body)
        assert result.error is None and result.ttft_s is not None
        assert 0 <= result.ttft_s <= result.latency_s
    assert len(seen) == 4
    assert all(b["stream"] and b["model"] == "qwen-demo" for b in seen)
    assert seen[3]["messages"] != seen[0]["messages"]  # a new conversation, a new image
    nameless = ChatConversation(pool, turns=1, model=None).next_request()
    failed = chat_turn(client, url, nameless.body)
    assert failed.error and failed.error.startswith("HTTP 400")
    assert chat_turn(client, "http://llm:8001/elsewhere", nameless.body).error.startswith(
        "HTTP 404"
    )


def test_transport_errors_fail_the_turn_without_raising() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    result = chat_turn(client, "http://nowhere", {"messages": []})
    assert result.error == "ConnectError: refused"
    assert served_model("http://nowhere", client) is None
