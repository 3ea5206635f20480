"""The client SDK's four benchmark scripts: each parses its own flags and writes its own page.

No service here: each script's report is built from canned measurements, so a script that
lost a helper in the split (one benchmark per script, shared rig in ``client_rig``) fails here
without starting Ray.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
SCRIPTS = ("turns", "cached", "fetch", "chat")


def script(name: str) -> ModuleType:
    path = LOADTEST / f"bench_client_{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_client_{name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_answers_help_with_its_own_flags(name: str) -> None:
    out = subprocess.run(
        [sys.executable, str(LOADTEST / f"bench_client_{name}.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--out" in out and "--redis" in out
    own = {
        "turns": "--turns",
        "cached": "--block",
        "fetch": "--fetch-images",
        "chat": "--chat-turns",
    }
    assert own[name] in out
    for other, flag in own.items():
        if other != name:
            assert flag not in out, f"bench_client_{name}.py takes {other}'s {flag}"


def test_turns_report_reads_the_goal_from_the_encoder_time() -> None:
    turns = script("turns")

    def rows(encoder_ms: list[float], encoded: list[int]) -> list[dict]:
        return [
            {
                "turn": t,
                "images": t,
                "uploaded": 1000.0 * e,
                "encoded": e,
                "encoder_ms": ms,
                "encode_ms": ms + 20,
                "fetch_ms": 1.0 + t,
            }
            for t, (ms, e) in enumerate(zip(encoder_ms, encoded, strict=True), 1)
        ]

    flat = rows([100, 110, 105, 115], [1, 1, 1, 1])
    growing = rows([100, 200, 300, 400], [1, 2, 3, 4])
    page = turns.report(dict(zip(turns.STRATEGIES, [flat, growing, growing], strict=True)), 4)
    assert "encoder time turn 4 / turn 1 <= 1.2: 1.15x (met)" in page
    assert "(~4x expected): 4.0x" in page
    bad = turns.report(dict(zip(turns.STRATEGIES, [growing] * 3, strict=True)), 4)
    assert "4.00x (**missed**)" in bad


def test_cached_report_compares_direct_and_ingress() -> None:
    cached = script("cached")
    args = argparse.Namespace(reps=5, block=2, redis="redis://x:6379/14")
    result = {
        cached.DIRECT: {"p50": 0.5, "p90": 0.6},
        cached.HTTP: {"p50": 7.5, "p90": 9.0},
        "encoded": 0,
        "kb": 940.0,
    }
    page = cached.report(result, args)
    assert "| ingress / direct | 15.0x | 15.0x |" in page
    assert "0.500 ms (met); >= 10x faster than through the ingress: 15.0x (met)" in page


def test_fetch_report_states_the_ratio_against_raw() -> None:
    fetch = script("fetch")
    args = argparse.Namespace(reps=5, fetch_size=448)
    result = {
        "images": 2,
        "rows": 512,
        "nbytes": 262_144,
        "per_call": 262_144,
        "width": 256,
        "dtype": "bf16",
        "spans": 4,
        "raw_ms": 1.0,
        "sdk_ms": 1.25,
        "ratio": 0.8,
        "raw2_ms": 1.0,
        "nov_ms": 1.1,
        "ratio_nov": 0.9,
    }
    page = fetch.report(result, args)
    assert "| `client.fetch_chunk` | 1.25 | 210 | 0.80 |" in page
    assert "0.80x (**missed**)" in page


def test_chat_report_counts_turns_where_usage_and_counters_disagree() -> None:
    chat = script("chat")

    def rows(encoder_ms: list[float], encoded: list[int], usage: list[int]) -> list[dict]:
        return [
            {
                "turn": t,
                "images": t,
                "ttft_ms": 100.0 * t,
                "encoded": e,
                "encoder_ms": ms,
                "stopped_at_once": False,
                "prompt_tokens": 90 * t,
                "images_encoded": u,
                "rows_pulled": 64 * t,
                "prefill_chunks": 1,
            }
            for t, (ms, e, u) in enumerate(zip(encoder_ms, encoded, usage, strict=True), 1)
        ]

    per = rows([100, 105, 110], [1, 1, 1], [1, 1, 1])
    none = rows([100, 200, 300], [1, 2, 3], [1, 2, 2])
    result = {
        "rows": dict(zip(chat.CHAT_STRATEGIES, [per, none], strict=True)),
        "chunk": 512,
        "deploy_s": 6.0,
        "threads": "unset",
    }
    page = chat.report(result, argparse.Namespace(size=224, max_tokens=4))
    assert "disagreed in 0 / 1 turns" in page
    assert "encoder time turn 3 / turn 1 <= 1.2: 1.10x (met)" in page


def test_the_fetch_script_measures_a_short_run(redis_url: str) -> None:
    """The one client benchmark that reads the store's layout itself (the raw side's keys):
    a short run over the suite's Redis reads the same bytes both ways."""
    out = subprocess.run(
        [
            sys.executable,
            str(LOADTEST / "bench_client_fetch.py"),
            *("--reps", "3", "--fetch-images", "2", "--fetch-size", "224"),
            *("--redis", redis_url),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if "store bytes_read per fetch_chunk" in x)
    per_call, raw = re.search(r"fetch_chunk ([\d,]+) \(raw spans ([\d,]+)\)", line).groups()
    assert per_call == raw and int(raw.replace(",", "")) > 0, line
