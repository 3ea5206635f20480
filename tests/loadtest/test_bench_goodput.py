"""The goodput benchmark's workload and verdicts (``loadtest/bench_goodput.py``), without
servers: the schedule is the same for every setup, open-loop and as stated; goodput counts
only requests within both SLOs."""

from __future__ import annotations

import argparse

import pytest

from loadtest import bench_goodput as g


def _args(**kw: object) -> argparse.Namespace:
    base = {
        "seed": 0,
        "duration": 60.0,
        "conversations": 4,
        "turns": 3,
        "text_share": 0.2,
        "shared_share": 0.3,
        "max_tokens": 16,
        "slos": "1:0.1,2:0.2",
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(autouse=True)
def small_images(monkeypatch: pytest.MonkeyPatch) -> None:
    from loadtest import bench_vllm

    monkeypatch.setattr(bench_vllm, "SIDE", 28)


def test_the_schedule_is_the_same_every_time_and_as_stated() -> None:
    args = _args()
    a, b = g.schedule(2.0, args, 1), g.schedule(2.0, args, 1)
    assert [(x.at, x.messages) for x in a] == [(x.at, x.messages) for x in b]
    assert 80 <= len(a) <= 160  # Poisson at 2/s for 60 s
    assert all(0 <= x.at < 60 for x in a) and [x.at for x in a] == sorted(x.at for x in a)
    text = [x for x in a if x.conversation < 0]
    assert 0.1 < len(text) / len(a) < 0.3 and all(x.images == 0 for x in text)
    turns = [x for x in a if x.conversation >= 0]
    # history re-sent: a turn's messages are the conversation's earlier turns and replies
    for x in turns:
        users = [m for m in x.messages if m["role"] == "user"]
        assert len(users) == x.images <= args.turns
        assert len(x.messages) == 2 * x.images - 1
    shared = sum(x.new_images == 0 for x in turns)
    assert 0.15 < shared / len(turns) < 0.45
    assert len({x.conversation for x in turns}) > args.conversations  # conversations restart


def test_goodput_needs_both_slos_and_no_error() -> None:
    slo = (1.0, 0.1)
    assert g.Result(0.5, 0.05, 16).good(slo)
    assert not g.Result(1.5, 0.05, 16).good(slo)
    assert not g.Result(0.5, 0.2, 16).good(slo)
    assert not g.Result(0.5, 0.05, 16, error="HTTP 500").good(slo)
    point = g.RatePoint(1.0, 4, 4, 4, 2.0, [g.Result(0.5, 0.05, 16)] * 3 + [g.Result(error="x")])
    assert g.summary(point, slo) == (0.75, 1.5)


def test_the_verdict_is_read_at_the_highest_rate_vllm_alone_half_meets() -> None:
    ok, late = g.Result(0.5, 0.05, 16), g.Result(5.0, 0.05, 16)
    runs = {
        "A": [g.RatePoint(1, 2, 0, 0, 1, [ok, ok]), g.RatePoint(2, 2, 0, 0, 1, [ok, late])],
        "B": [g.RatePoint(1, 2, 0, 0, 1, [ok, ok]), g.RatePoint(2, 2, 0, 0, 1, [ok, ok])],
        "C": [g.RatePoint(1, 2, 0, 0, 1, [ok, ok]), g.RatePoint(2, 2, 0, 0, 1, [ok, late])],
    }
    lines = g.verdict(_args(), runs, (1.0, 0.1))
    assert lines[0].startswith("- at 2 req/s") and "2.00x (target >= 1.5x): met" in lines[0]
    assert "2.00x (target >= 1.2x): met" in lines[1]
