"""Goodput under an open-loop chat load at equal hardware: vLLM alone, vLLM + vitserve and vLLM's
own encoder disaggregation (EPD), one setup at a time on the same two cores (issue 40).

Goodput as vLLM's serving benchmark defines it: the requests that meet a time-to-first-token
*and* a time-per-output-token SLO, per second, and as a share of those sent, for two SLO pairs.

Setups (every vLLM server fp32, chunked prefill in ``--chunk``-token chunks, prefix caching on
except on the EPD producer; each role pinned to its cores with ``taskset`` and, for vLLM,
``VLLM_CPU_OMP_THREADS_BIND``; how a setup divides the two cores is its own choice, as a fleet
is sized to its load):

* ``A`` vLLM alone: two vLLM replicas, one per core, conversation-sticky routing (a
  conversation's turns always go to the same replica, so its prefix cache works; text-only
  requests alternate);
* ``B`` vLLM + vitserve: ``vitserve serve`` (its encoder, one torch thread, and the front) on
  core 0, one vLLM replica with vitserve's connector (``ec_consumer``, reading the Redis store)
  on core 1; requests go to vitserve's vLLM front, which hands vLLM each chat at its images'
  claims (``--overlap``; the encoder has a core of its own);
* ``C`` vLLM EPD: an encoder-only producer (``--mm-encoder-only``, ``ECExampleConnector``) on
  core 0, one consumer on core 1; each request goes to the producer (``max_tokens`` 1), then,
  streamed, to the consumer.

Workload (the same for every setup, from ``--seed``): Poisson arrivals at each ``--rates``
rate for ``--duration`` seconds. An arrival is a text-only request (``--text-share``), or the
next turn of one of ``--conversations`` conversations picked at random: each turn re-sends the
whole history (fixed assistant replies, so every setup sees the same prompts) and adds one
image, one of a small pool shared by every user (``--shared-share``: documents, screenshots an
agent sends again) or a new one (random RGB ``--side`` px JPEG); after ``--turns`` turns a
conversation starts over. Every request asks for ``--max-tokens`` tokens (``ignore_eos``), so
its time per output token is measured on the same number of tokens everywhere.

TTFT: from the request's scheduled arrival to the first streamed token (the first SSE chunk
with content); TPOT: from that token to the last, over the tokens between. A request that
fails or is not answered within ``--timeout`` counts as missing both SLOs.

    .venv/bin/python loadtest/bench_goodput.py --model tiny --out loadtest/results/goodput-cpu.md

Needs vLLM's virtual environment (``tests/vllm/make_env.sh``), ``taskset`` and a Redis server
(``--store``; its database is flushed before a ``B`` run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.bench_vllm import (  # noqa: E402
    VitserveServer,
    flush_redis,
    git_state,
    image_part,
)
from loadtest.vllm_peer import VllmServer  # noqa: E402
from vitserve.deployments.runner.local import free_port  # noqa: E402

SETUPS = {"A": "vLLM alone", "B": "vLLM + vitserve", "C": "vLLM EPD"}
MODEL_NAME = "bench"
SHARED_POOL = 4  # images every user may send


# -- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it is sent (s from the start), its chat messages, the
    conversation it belongs to (-1: a text-only request) and its images' counts."""

    at: float
    messages: list[dict[str, Any]]
    conversation: int
    images: int
    new_images: int


def schedule(rate: float, args: argparse.Namespace, seed_base: int) -> list[Arrival]:
    """The arrivals at ``rate`` per second for ``--duration`` s (see the module)."""
    rng = random.Random(args.seed * 1_000_003 + seed_base)
    histories: dict[int, list[dict[str, Any]]] = {}
    next_id = args.conversations
    slots = list(range(args.conversations))
    image_seed = seed_base * 10_000
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < args.duration:
        if rng.random() < args.text_share:
            words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(12))
            messages = [{"role": "user", "content": f"Summarize: {words}"}]
            out.append(Arrival(t, messages, -1, 0, 0))
        else:
            slot = rng.randrange(len(slots))
            conv = slots[slot]
            history = histories.setdefault(conv, [])
            if len(history) >= 2 * args.turns:  # over: a new conversation in its place
                conv = slots[slot] = next_id
                next_id += 1
                history = histories.setdefault(conv, [])
            if rng.random() < args.shared_share:
                seed, new = 900_000_000 + rng.randrange(SHARED_POOL), 0
            else:
                image_seed += 1
                seed, new = image_seed, 1
            turn = len(history) // 2 + 1
            history.append(
                {
                    "role": "user",
                    "content": [image_part(seed), {"type": "text", "text": f"Turn {turn}?"}],
                }
            )
            images = sum(1 for m in history if isinstance(m["content"], list))
            out.append(Arrival(t, list(history), conv, images, new))
            history.append({"role": "assistant", "content": f"Noted, image {turn}."})
        t += rng.expovariate(rate)
    return out


def body(arrival: Arrival, max_tokens: int, stream: bool = True) -> bytes:
    doc = {
        "model": MODEL_NAME,
        "messages": arrival.messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return json.dumps(doc).encode()


# -- the setups ----------------------------------------------------------------------------------
class PinnedVllm(VllmServer):
    """A vLLM server whose every process runs on ``cores`` (``taskset``), OpenMP bound there."""

    def __init__(self, cores: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cores = cores
        self.extra_env["VLLM_CPU_OMP_THREADS_BIND"] = cores

    def command(self) -> list[str]:
        return ["taskset", "-c", self.cores, *super().command()]


class Setup:
    """One setup's servers, started for a run and stopped after; ``send`` routes a request."""

    def __init__(self, name: str, args: argparse.Namespace, model: Path, logs: Path) -> None:
        self.name, self.args, self.model, self.logs = name, args, model, logs
        self.stack = contextlib.ExitStack()
        self.llm: list[VllmServer] = []
        self.producer: VllmServer | None = None
        self.vitserve: VitserveServer | None = None
        self.turns = 0

    def _vllm(self, label: str, cores: str, extra: list[str]) -> VllmServer:
        common = [
            "--max-model-len",
            "8192",
            "--max-num-batched-tokens",
            str(self.args.chunk),
            "--max-num-seqs",
            "8",
        ]
        server = PinnedVllm(
            cores,
            self.args.vllm_python,
            str(self.model),
            free_port(),
            "float32",
            str(self.logs / f"{self.name}-{label}.log"),
            served_model_name=MODEL_NAME,
            ready_timeout=300.0,
            extra_env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
            extra_args=common + extra,
            max_images=self.args.turns,
        )
        return server

    def __enter__(self) -> Setup:
        started: list[Any] = []
        if self.name == "A":
            self.llm = [self._vllm(f"vllm{i}", str(i), []) for i in range(2)]
        elif self.name == "B":
            flush_redis(self.args.store)
            vport = free_port()
            ec = {
                "ec_connector": "VitserveECConnector",
                "ec_connector_module_path": "vitserve.client.vllm",
                "ec_role": "ec_consumer",
                "ec_connector_extra_config": {
                    "url": f"http://127.0.0.1:{vport}",
                    "store": self.args.store,
                },
            }
            self.llm = [self._vllm("consumer", "1", ["--ec-transfer-config", json.dumps(ec)])]
            self.vitserve = VitserveServer(
                self.args.vitserve,
                self.model,
                self.args.store,
                vport,
                [s.url for s in self.llm],
                str(self.logs / "B-vitserve.log"),
            )
            self.vitserve.cmd = [
                "taskset",
                "-c",
                "0",
                *self.vitserve.cmd,
                "--set",
                "torch_threads=1",
                "--set",  # the encoder has a core of its own: vLLM starts at the claims
                f"vllm.overlap={'true' if self.args.overlap else 'false'}",
            ]
        else:
            folder = tempfile.mkdtemp(prefix="epd-", dir=self.logs)

            def ec(role: str) -> list[str]:
                cfg = {
                    "ec_connector": "ECExampleConnector",
                    "ec_role": role,
                    "ec_connector_extra_config": {"shared_storage_path": folder},
                }
                return ["--ec-transfer-config", json.dumps(cfg)]

            self.producer = self._vllm(
                "producer",
                "0",
                ["--mm-encoder-only", "--no-enable-prefix-caching", *ec("ec_producer")],
            )
            self.llm = [self._vllm("consumer", "1", ec("ec_consumer"))]
        servers = [*self.llm, *([self.producer] if self.producer else [])]
        servers += [self.vitserve] if self.vitserve else []
        try:
            for server in servers:  # one at a time: two cores
                server.__enter__()
                started.append(server)
                self.stack.push(server)
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def send(self, client: httpx.Client, arrival: Arrival, t0: float) -> Result:
        """The arrival through the setup, timed from its scheduled time ``t0 + at``."""
        path = "/v1/chat/completions"
        start = t0 + arrival.at
        try:
            if self.name == "B":
                assert self.vitserve is not None
                return stream(client, self.vitserve.url + "/vllm" + path, arrival, start, self.args)
            if self.name == "A":
                if arrival.conversation >= 0:
                    server = self.llm[arrival.conversation % len(self.llm)]
                else:
                    self.turns += 1
                    server = self.llm[self.turns % len(self.llm)]
                return stream(client, server.url + path, arrival, start, self.args)
            assert self.producer is not None
            if arrival.images:
                r = client.post(
                    self.producer.url + path,
                    content=body(arrival, 1, stream=False),
                    headers={"content-type": "application/json"},
                )
                if r.status_code != 200:
                    return Result(error=f"producer {r.status_code}")
            return stream(client, self.llm[0].url + path, arrival, start, self.args)
        except (httpx.HTTPError, RuntimeError) as exc:
            return Result(error=f"{type(exc).__name__}: {exc}"[:200])


@dataclass
class Result:
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None

    def good(self, slo: tuple[float, float]) -> bool:
        return (
            self.error is None
            and self.ttft is not None
            and self.tpot is not None
            and self.ttft <= slo[0]
            and self.tpot <= slo[1]
        )


def stream(
    client: httpx.Client, url: str, arrival: Arrival, start: float, args: argparse.Namespace
) -> Result:
    """A streamed chat: the first content token's time from ``start`` and the mean time per
    output token after it."""
    first = last = None
    tokens = 0
    with client.stream(
        "POST",
        url,
        content=body(arrival, args.max_tokens),
        headers={"content-type": "application/json"},
    ) as r:
        if r.status_code != 200:
            return Result(error=f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            doc = json.loads(data)
            if "error" in doc:
                return Result(error=str(doc["error"])[:200])
            choices = doc.get("choices") or []
            # a token's chunk carries a content delta, "" for a token that decodes to nothing
            # (random weights emit such tokens); vLLM's first chunk, the role's, is no token
            delta = (choices[0].get("delta") or {}) if choices else {}
            if delta.get("content") is not None and "role" not in delta:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                tokens += 1
    if first is None or last is None:
        return Result(error="no token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return Result(first - start, tpot, tokens)


# -- a run ---------------------------------------------------------------------------------------
@dataclass
class RatePoint:
    rate: float
    sent: int
    images: int
    new_images: int
    wall_s: float
    results: list[Result] = field(default_factory=list)


def run_rate(setup: Setup, arrivals: list[Arrival], rate: float) -> RatePoint:
    """Send ``arrivals`` open-loop (each at its time, whatever the earlier ones are doing)."""
    point = RatePoint(
        rate,
        len(arrivals),
        sum(a.images for a in arrivals),
        sum(a.new_images for a in arrivals),
        0.0,
    )
    lock = threading.Lock()
    timeout = httpx.Timeout(setup.args.timeout, connect=10.0)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    with httpx.Client(timeout=timeout, limits=limits) as client, ThreadPoolExecutor(128) as pool:
        t0 = time.perf_counter() + 0.5

        def one(arrival: Arrival) -> None:
            delay = t0 + arrival.at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            result = setup.send(client, arrival, t0)
            with lock:
                point.results.append(result)

        futures = [pool.submit(one, a) for a in arrivals]
        for f in futures:
            f.result()
        point.wall_s = time.perf_counter() - t0
    return point


def slos(text: str) -> list[tuple[float, float]]:
    """``"2:0.2,4:0.4"`` -> [(ttft_s, tpot_s), ...]."""
    out = []
    for pair in text.split(","):
        ttft, tpot = pair.split(":")
        out.append((float(ttft), float(tpot)))
    return out


def summary(point: RatePoint, slo: tuple[float, float]) -> tuple[float, float]:
    """(the share of requests within ``slo``, good requests per second)."""
    good = sum(r.good(slo) for r in point.results)
    return good / max(point.sent, 1), good / max(point.wall_s, 1e-9)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def page(
    args: argparse.Namespace,
    runs: dict[str, list[RatePoint]],
    started: datetime,
    took: float,
    commit: str,
) -> list[str]:
    from vitserve.encoder.device import cpu_model

    lines = [
        f"# Goodput under an open-loop chat load: vLLM alone, with vitserve, and vLLM EPD "
        f"(`{args.model}` model)",
        "",
        f"Commit {commit}, run {started:%Y-%m-%d %H:%M} UTC ({took / 60:.0f} min). "
        f"Machine: {cpu_model()}, {os.cpu_count()} vCPUs, no GPU. "
        f"Command: `{' '.join(sys.argv)}`.",
        "",
        "Setups, each alone on the same two cores (how a setup divides them is its choice): "
        "**vLLM alone**: two vLLM replicas, one per core, conversation-sticky routing; "
        "**vLLM + vitserve**: `vitserve serve` (encoder, one torch thread, and front) on core 0, "
        "one vLLM replica with vitserve's connector on core 1, the front's overlap "
        f"{'on' if args.overlap else 'off'}; **vLLM EPD**: the encoder-only "
        "producer on core 0, one consumer on core 1. Every vLLM fp32, chunked prefill in "
        f"{args.chunk}-token chunks, `--max-num-seqs 8`.",
        "",
        f"Workload: Poisson arrivals for {args.duration:.0f} s at each rate; "
        f"{args.text_share:.0%} text-only requests; the rest are turns of "
        f"{args.conversations} concurrent conversations (history re-sent, one image a turn, "
        f"{args.turns} turns then a new conversation), each image one of {SHARED_POOL} shared "
        f"by every user with probability {args.shared_share:.0%}, else new "
        f"({args.side}x{args.side} random JPEG); {args.max_tokens} output tokens "
        "(`ignore_eos`). TTFT from the scheduled arrival to the first token; TPOT the mean "
        "time per token after it. Goodput: requests within TTFT and TPOT SLO, as a share of "
        "those sent and per second.",
        "",
    ]
    pairs = slos(args.slos)
    for slo in pairs:
        lines += [
            f"## SLO: TTFT <= {slo[0]:g} s and TPOT <= {slo[1]:g} s",
            "",
            "| rate (req/s) | setup | sent | images (new) | within SLO | goodput (req/s) | "
            "TTFT p50 / p90 (s) | TPOT p50 (ms) | errors |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for rate in args.rates:
            for name in args.order:
                point = next((p for p in runs.get(name, []) if p.rate == rate), None)
                if point is None:
                    continue
                share, per_s = summary(point, slo)
                ttfts = [r.ttft for r in point.results if r.ttft is not None]
                tpots = [r.tpot * 1e3 for r in point.results if r.tpot is not None]
                errors = sum(r.error is not None for r in point.results)
                p90 = sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
                lines.append(
                    f"| {rate:g} | {SETUPS[name]} | {point.sent} | {point.images} "
                    f"({point.new_images}) | {share:.0%} | {per_s:.2f} | "
                    f"{med(ttfts):.2f} / {p90:.2f} | {med(tpots):.0f} | {errors} |"
                )
        lines += ["", *verdict(args, runs, slo), ""]
    errors = sorted(
        {
            (SETUPS[n], p.rate, r.error)
            for n, ps in runs.items()
            for p in ps
            for r in p.results
            if r.error
        }
    )
    if errors:
        lines += ["## Errors (setup, rate, the first words of each)", ""]
        lines += [f"- {name}, {rate:g} req/s: {error[:160]}" for name, rate, error in errors]
        lines.append("")
    return lines


def verdict(
    args: argparse.Namespace, runs: dict[str, list[RatePoint]], slo: tuple[float, float]
) -> list[str]:
    """Issue 40's target at ``slo``: at the highest rate where vLLM alone meets it for at least
    half its requests, vLLM + vitserve's goodput >= 1.5x vLLM alone's and >= 1.2x EPD's."""
    alone = {p.rate: summary(p, slo) for p in runs.get("A", [])}
    ok = [rate for rate, (share, _) in alone.items() if share >= 0.5]
    if not ok or "B" not in runs:
        return ["- target: not evaluated (vLLM alone never met the SLO half the time)"]
    rate = max(ok)
    b = next(summary(p, slo) for p in runs["B"] if p.rate == rate)
    a = alone[rate]
    out = [
        f"- at {rate:g} req/s (the highest rate where vLLM alone meets the SLO for half its "
        f"requests): vLLM + vitserve {b[1]:.2f} good req/s vs vLLM alone {a[1]:.2f}: "
        f"{b[1] / max(a[1], 1e-9):.2f}x (target >= 1.5x): "
        f"{'met' if b[1] >= 1.5 * a[1] else '**missed**'}"
    ]
    c = next((summary(p, slo) for p in runs.get("C", []) if p.rate == rate), None)
    if c is not None:
        out.append(
            f"- at {rate:g} req/s: vLLM + vitserve vs vLLM EPD {c[1]:.2f} good req/s: "
            f"{b[1] / max(c[1], 1e-9):.2f}x (target >= 1.2x): "
            f"{'met' if b[1] >= 1.2 * c[1] else '**missed**'}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="test-model preset (qwen2_vl, vllm=True)")
    parser.add_argument("--order", default="ABC", help="setups, one at a time")
    parser.add_argument("--rates", default="1,2,4", help="arrivals per second")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--text-share", type=float, default=0.2)
    parser.add_argument("--shared-share", type=float, default=0.3)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vitserve's front hands vLLM a chat at its images' claims (B)",
    )
    parser.add_argument("--slos", default="1:0.1,2:0.2", help="TTFT_s:TPOT_s pairs")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vitserve", default=str(Path(sys.executable).parent / "vitserve"))
    parser.add_argument("--logs", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.side % 28:
        parser.error("--side must be a multiple of 28 (patch 14, merge 2)")
    from loadtest import bench_vllm

    bench_vllm.SIDE = args.side  # the images' side (image_part draws through new_jpeg)
    from vitserve.testing.models import cached_model

    model = cached_model("qwen2_vl", args.model, vllm=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="goodput-"))
    logs.mkdir(parents=True, exist_ok=True)
    started, t_start, commit = datetime.now(timezone.utc), time.perf_counter(), git_state()
    plans = {rate: schedule(rate, args, i + 1) for i, rate in enumerate(args.rates)}
    runs: dict[str, list[RatePoint]] = {}
    for name in args.order:
        print(f"== {SETUPS[name]}: starting", flush=True)
        with Setup(name, args, model, logs) as setup:
            for rate in args.rates:
                point = run_rate(setup, plans[rate], rate)
                runs.setdefault(name, []).append(point)
                shares = [f"{summary(point, s)[0]:.0%}" for s in slos(args.slos)]
                print(
                    f"  {SETUPS[name]:<16} {rate:g} req/s: sent {point.sent}, within SLOs "
                    f"{' / '.join(shares)}, errors "
                    f"{sum(r.error is not None for r in point.results)}",
                    flush=True,
                )
                time.sleep(3)
    lines = page(args, runs, started, time.perf_counter() - t_start, commit)
    text = "\n".join(lines).rstrip() + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
