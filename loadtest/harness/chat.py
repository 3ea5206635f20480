"""One chat turn against any OpenAI-compatible chat completions server, streamed: its time to the
first token (TTFT), its end-to-end latency and its ``usage``.

The ``chat`` scenario's users call :func:`chat_turn` with a base URL, the part before
``/v1/chat/completions``: vitserve's prefill application (``http://host:port/prefill``, what
``vitserve serve --prefill`` runs), vitserve's vLLM front (``http://host:port/vllm``, with
``--vllm-url``), or a vLLM (or any OpenAI-compatible) server itself (``http://host:8001``).
:func:`served_model` reads the name to send as ``model`` from the server's ``GET /v1/models``.

Invariants:

* TTFT is the time from sending the request to the first server-sent event that carries a token
  or the finish: the first chunk with a choice whose delta has no ``role`` (the role chunk of
  OpenAI's and vLLM's streams, and of the prefill application, which sends it only once the
  prefill is done, carries no token). A stream that ends without one has no TTFT and fails.
* A turn fails (``error`` set) on a status other than 200, a transport error or timeout, an
  ``error`` object in the stream, or a stream without ``[DONE]``; it never raises.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["TurnResult", "chat_turn", "read_stream", "served_model"]

ROUTE = "/v1/chat/completions"


@dataclass
class TurnResult:
    latency_s: float
    ttft_s: float | None = None
    error: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    text: str = ""


def read_stream(lines: Iterable[str], clock: Any, started: float) -> TurnResult:
    """Read a chat completions SSE stream (its lines) into a :class:`TurnResult`; ``clock()``
    is read at the first token and at the end."""
    result = TurnResult(latency_s=0.0)
    done = False
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            result.error = f"error event: {str(event['error'])[:200]}"
            break
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if "role" in delta and choice.get("finish_reason") is None:
                continue
            if result.ttft_s is None:
                result.ttft_s = clock() - started
            result.text += delta.get("content") or ""
    result.latency_s = clock() - started
    if result.error is None and not done:
        result.error = "stream ended without [DONE]"
    elif result.error is None and result.ttft_s is None:
        result.error = "stream had no token"
    return result


def chat_turn(
    client: httpx.Client, url: str, body: dict[str, Any], clock: Any = time.perf_counter
) -> TurnResult:
    """POST ``body`` (``stream: true``) to ``{url}/v1/chat/completions`` and read the stream."""
    started = clock()
    try:
        with client.stream("POST", url.rstrip("/") + ROUTE, json=body) as response:
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                return TurnResult(
                    clock() - started, error=f"HTTP {response.status_code}: {text[:200]}"
                )
            return read_stream(response.iter_lines(), clock, started)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return TurnResult(clock() - started, error=f"{type(exc).__name__}: {exc}"[:200])


def served_model(url: str, client: httpx.Client | None = None, timeout_s: float = 30) -> str | None:
    """The first model id of ``{url}/v1/models`` (``None`` when it does not answer one)."""
    try:
        if client is None:
            answer = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout_s)
        else:
            answer = client.get(url.rstrip("/") + "/v1/models")
        answer.raise_for_status()
        return str(answer.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
