"""The harness end to end, short, against a stand-in server on loopback (no Ray, no model): the
driver runs the open-loop generator and locust's chat users as their own processes, reads
their records and writes each scenario's report. The chat scenario is pointed at an
OpenAI-compatible base URL of its own (``--chat-url``), as it would be at a vLLM server.

Marked heavy by hand (``subprocess``): the generators are processes.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from loadtest.harness import run

CHATS: list[dict] = []  # the chat bodies the stand-in received


class StandIn(BaseHTTPRequestHandler):
    """``POST /v1/encode`` (one item per image), ``/metrics``, ``/healthz``, and an OpenAI chat
    server under ``/llm`` (model ``stand-in``, a streamed two-token answer)."""

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/llm/v1/models":
            self._send(200, json.dumps({"data": [{"id": "stand-in"}]}).encode())
        elif self.path in ("/metrics", "/healthz"):
            self._send(200, b"", "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/encode":
            n = body.count(b'name="images"')
            self._send(200, json.dumps({"items": [{"key": "k"}] * n}).encode())
        elif self.path == "/llm/v1/chat/completions":
            request = json.loads(body)
            CHATS.append(request)
            if request.get("model") != "stand-in":
                self._send(400, b'{"error": {"message": "unknown model"}}')
                return
            events = [
                {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "a"}}]},
                {"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]},
            ]
            stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, stream.encode(), "text/event-stream")
        else:
            self._send(404, b"{}")


@pytest.fixture
def stand_in() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_open_loop_and_chat_points_end_to_end(stand_in: str, tmp_path: Path) -> None:
    CHATS.clear()
    code = run.main(
        [
            "open",
            "chat",
            "--url",
            stand_in,
            "--chat-url",
            f"{stand_in}/llm",
            "--run-time",
            "4",
            "--rates",
            "20",
            "--other-users",
            "2",
            "--chat-turns",
            "3",
            "--slo-ms",
            "500",
            "2000",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    (open_dir,) = tmp_path.glob("open-*")
    (chat_dir,) = tmp_path.glob("chat-*")

    stats = json.loads((open_dir / "stats.json").read_text())
    (point,) = stats["runs"]
    records = (open_dir / "r20_records.jsonl").read_text().splitlines()
    assert point["requests"] == len(records) > 30  # ~80 arrivals in 4 s
    assert point["failures"] == 0 and point["overflow"] == 0
    assert not point["rule"]["met"]  # 4 s and < 1000 requests: marked, not published
    page = (open_dir / "report.md").read_text()
    assert "| 20 req/s |" in page and "**1 of 1 points are below it**" in page
    assert {"latency_percentiles.png", "goodput.png", "in_flight_over_time.png"} <= set(
        stats["plots"]
    )

    chat = json.loads((chat_dir / "stats.json").read_text())
    assert chat["chat"] == {"url": f"{stand_in}/llm", "model": "stand-in"}
    (turns,) = chat["runs"]
    assert turns["requests"] > 0 and turns["failures"] == 0
    assert turns["slo_metric"] == "ttft" and turns["ttft_p50_ms"] <= turns["p50_ms"]
    assert set(turns["by_k"]) <= {"1", "2", "3"}  # turn t carries t images
    assert all(body["model"] == "stand-in" and body["stream"] for body in CHATS)
    most = max(len(b["messages"]) for b in CHATS)
    assert most == 5  # turn 3: three user messages and two replies
    page = (chat_dir / "report.md").read_text()
    assert re.search(r"\| 2 users \| \d+ \| 0 \|", page)
    assert "Time to first token" in page


def test_a_closed_loop_point_under_the_rule_lasts_its_minimum_from_its_first_request(
    stand_in: str, tmp_path: Path
) -> None:
    """The point's length counts from its first request's start, the window its report
    measures, so the window lasts at least the minimum (counted from locust's start instead,
    it came out short by the users' start-up: published points read '60 s < 60 s')."""
    length = ["--min-run-time", "3", "--min-requests", "20"]  # the rule's shape, shorter
    out = ["--slo-ms", "500", "2000", "--out", str(tmp_path)]
    code = run.main(["random", "--url", stand_in, "--users", "2", *length, *out])
    assert code == 0
    (point,) = json.loads(next(tmp_path.glob("random-*/stats.json")).read_text())["runs"]
    assert point["requests"] >= 20 and point["failures"] == 0
    assert point["duration_s"] >= 3.0, point["duration_s"]
