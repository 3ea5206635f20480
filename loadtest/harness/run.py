"""Run the scenarios: start a server (unless ``--url``), run each point of each scenario, scrape
/metrics, write ``<out>/<scenario>-<timestamp>/`` (``report.md``, ``stats.json``, plots, and
every request's record in ``<point>_records.jsonl``).

    python -m loadtest.harness [random agent cache_off step open chat] [--users 1 2 4]
        [--rates 0.25 0.5] [--run-time 20] [--slo-ms 2000 10000] [--url http://host:8000]
        [--chat-url http://host:8001] [--set encoder.autoscaling.max_replicas=2 ...]

A point's length: by default the publishing rule (each point runs until it has lasted at least
``--min-run-time`` (60) seconds *and* answered ``--min-requests`` (1,000) requests, or until
``--max-run-time``); ``--run-time T`` runs each point exactly T seconds instead (a short
development run, marked below the rule in its report). Closed-loop points run locust
(``locustfile.py``), open-loop points the asyncio generator (``openloop.py``), each in its own
process.

Invariants:

* Every point's report row says whether it meets the publishing rule (>= 60 s and >= 1,000
  requests), whatever flags shortened or lengthened its run.
* Every point's latency, throughput and goodput come from its own per-request records, at the
  scenario's two SLOs (``--slo-ms`` or :data:`SLOS`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.harness import monitor, report, server
from loadtest.harness.load import PUBLISH_MIN_REQUESTS, PUBLISH_MIN_S, RunLength
from loadtest.harness.measures import read_records

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DESCRIPTIONS = {
    "random": "random multimodal: 1-4 images per request, 224px to 720p, 30% duplicates, "
    "POST /v1/encode (multipart)",
    "agent": "multi-turn agent through the SDK (EncoderClient.encode): turn t re-sends the "
    "conversation's t-1 images plus one new, 6 turns per conversation",
    "cache_off": "cache-off stress: 1-4 images per request, every image new",
    "step": "step load (low -> high -> low users) on POST /v1/encode, random multimodal mix; "
    "encoder replicas recorded from serve.status() in the server process",
    "open": "open loop: Poisson arrivals at a set rate (requests/s), the random multimodal mix "
    "on POST /v1/encode; an arrival that finds --max-in-flight requests in flight is not sent "
    "and counts as a failure (overflow)",
    "chat": "chat with images through an OpenAI-compatible chat completions route (vitserve's "
    "prefill application unless --chat-url): turn t re-sends the conversation's t-1 images "
    "plus one new (224px to 640x480, data: URLs), streamed, 8 tokens, 4 turns per conversation",
}
# Each scenario's SLO metric and its two SLOs (ms), for this kind of machine (2 CPU cores, the
# demo model on CPU). Tight, 2 s: about what one request takes on an idle service here (short
# runs on a 2-vCPU Xeon, 2026-11-26: random at 1 user p50 1.7 s, agent's turns p50 1.6 s, the
# chat's TTFT p50 1.4 s at 2 users; a 720p image's forward alone is ~1-2 s), so it holds only
# while requests do not queue; loose, 10 s: 5x that, what a batch or agent client waiting on a
# busy service may still accept (random at 4 users: p90 7.8 s). chat bounds TTFT (what
# vitserve's encode adds to), the others the whole request. On a GPU pass --slo-ms.
SLOS: dict[str, tuple[str, tuple[float, float]]] = {
    "random": ("e2el", (2000, 10000)),
    "agent": ("e2el", (2000, 10000)),
    "cache_off": ("e2el", (2000, 10000)),
    "step": ("e2el", (2000, 10000)),
    "open": ("e2el", (2000, 10000)),
    "chat": ("ttft", (2000, 10000)),
}
AGENT_NOTE = (
    "The SDK probes keys first (POST /v1/probe) and uploads only the new image, so the "
    "re-sent images never reach the ingress's store lookup: the service's hit rate stays ~0; "
    "the reuse shows as images sent (images/s) vs images encoded."
)
# Autoscaling on work (vitserve.deployments.encoder.autoscaling) on the embedded default (2 CPUs:
# ingress + encoders of 0.5 CPU each), short delays so the step shows both directions; --set
# adds to them (and overrides a setting it names).
STEP_SET = [
    "encoder.autoscaling.policy=work",
    "encoder.autoscaling.min_replicas=1",
    "encoder.autoscaling.max_replicas=2",
    "encoder.autoscaling.target_queue_delay_s=2",
    "encoder.autoscaling.upscale_delay_s=1",
    "encoder.autoscaling.downscale_delay_s=8",
    "encoder.num_cpus=0.5",
]


@dataclass
class Point:
    """One load level of a scenario."""

    label: str  # "2 users", "0.3 req/s", "1->4->1 users"
    slug: str  # file-name part
    users: int | None = None
    rate: float | None = None
    stages: list[list[float]] | None = None


def _users(n: int) -> str:
    return f"{n} user" if n == 1 else f"{n} users"


def points(name: str, args: argparse.Namespace) -> list[Point]:
    if name == "random":
        return [Point(_users(u), f"u{u}", users=u) for u in args.users]
    if name == "open":
        return [Point(f"{r:g} req/s", f"r{r:g}", rate=r) for r in args.rates]
    if name == "step":
        lo, hi, t1, t2, t3 = args.step
        stages: list[list[float]] = [[t1, lo], [t2, hi], [t3, lo]]
        return [Point(f"{lo}->{hi}->{lo} users", f"u{lo}_{hi}_{lo}", stages=stages)]
    u = args.other_users
    return [Point(_users(u), f"u{u}", users=u)]


def run_length(point: Point, args: argparse.Namespace) -> RunLength:
    if point.stages:  # the step load's own stages; the rule may hold its last stage longer
        end = point.stages[-1][0]
        if args.run_time is not None:
            return RunLength.fixed(end)
        return RunLength(args.min_run_time, args.min_requests, args.max_run_time).at_least(end)
    if args.run_time is not None:
        return RunLength.fixed(args.run_time)
    return RunLength(args.min_run_time, args.min_requests, args.max_run_time)


def _generator(point: Point, url: str, conf: dict[str, Any], prefix: Path) -> subprocess.Popen:
    if point.rate is not None:
        args = [sys.executable, "-m", "loadtest.harness.openloop"]
    else:
        args = [
            str(Path(sys.executable).with_name("locust")),
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "--host",
            url,
            "--csv",
            str(prefix),
            "--csv-full-history",
            "--only-summary",
            # a request in flight when the point ends finishes (or times out: 300 s) and is
            # recorded, never cut unrecorded
            "--stop-timeout",
            "330",
            "--loglevel",
            "WARNING",
        ]
    env = dict(os.environ, LOADTEST_CONF=json.dumps(conf), PYTHONPATH=str(ROOT))
    log = open(f"{prefix}_generator.log", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _wait_for_model(chat_url: str, progress: Any, timeout_s: float = 300) -> str | None:
    """The chat server's model (``GET /v1/models``), once it answers: the prefill application
    comes up after the encoder's ``/healthz`` answers. ``None`` if it never names one (then
    requests leave ``model`` out: the server's one model)."""
    from loadtest.harness.chat import served_model

    deadline = time.time() + timeout_s
    while (model := served_model(chat_url, timeout_s=10)) is None and time.time() < deadline:
        time.sleep(2)
    if model is None:
        progress.log(f"chat: {chat_url}/v1/models named no model in {timeout_s:g} s")
    return model


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def run_scenario(name: str, args: argparse.Namespace, progress: Any) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"{name}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    srv = None
    url = args.url
    # the step load's autoscaling settings first, so that --set (a model, say) adds to them
    # and overrides what it names
    settings = [*(STEP_SET if name == "step" else []), *(args.set or [])]
    extra = [f for s in settings for f in ("--set", s)]
    chat_url = None
    if name == "chat":
        chat_url = args.chat_url
        if not chat_url and not url:
            extra.append("--prefill")
    if not url and not chat_url:
        from vitserve.deployments.runner.local import free_port

        srv = server.Server(free_port(), extra, out)
        progress.log(f"{name}: starting vitserve serve {' '.join(extra)}")
        try:
            srv.wait_ready()
        except BaseException:
            srv.stop()
            raise
        url = srv.url
    if name == "chat" and not chat_url:
        chat_url = f"{url}/prefill"
    metric, slos = SLOS[name]
    if args.slo_ms:
        slos = tuple(args.slo_ms)
    stats: dict[str, Any] = {
        "scenario": name,
        "description": DESCRIPTIONS[name],
        "started": stamp,
        "server": {"url": url, "flags": extra},
        "generator": "open loop: asyncio + httpx, 1 process"
        if name == "open"
        else "closed loop: locust (headless, 1 process), users = concurrency",
        "slo_metric": metric,
        "slos_ms": list(slos),
        "rule": {"min_s": PUBLISH_MIN_S, "min_requests": PUBLISH_MIN_REQUESTS},
        "run_mode": f"fixed {args.run_time} s per point"
        if args.run_time is not None
        else f"until >= {args.min_run_time:g} s and >= {args.min_requests} requests "
        f"(at most {args.max_run_time:g} s)",
        "runs": [],
        "timeline": [],
        "notes": [],
    }
    if chat_url:
        # the server started here: wait for its prefill application whatever the model
        named = None if args.chat_model and not srv else _wait_for_model(chat_url, progress)
        model = args.chat_model or named
        stats["chat"] = {"url": chat_url, "model": model}
    try:
        from loadtest.bench_hot_path import machine

        stats["machine"] = machine()
    except Exception as exc:
        stats["machine"] = {"error": repr(exc)}
    mon = monitor.Monitor(url) if url else None
    if mon:
        mon.start()
    try:
        for i, point in enumerate(points(name, args)):
            length = run_length(point, args)
            prefix = out / point.slug.replace(".", "_")
            records_path = Path(f"{prefix}_records.jsonl")
            meta_path = Path(f"{prefix}_meta.json")
            conf = {
                "scenario": name,
                "seed": i + 1,
                "run_id": f"{stamp}-{i}",
                "k_min": 1,
                "k_max": 4,
                "duplicate_ratio": 0.3,
                "turns": args.chat_turns if name == "chat" else 6,
                "stages": point.stages or [[1e9, point.users]],
                "length": [length.min_s, length.min_requests, length.max_s],
                "records": str(records_path),
                # open loop
                "url": url,
                "rate": point.rate,
                "min_s": length.min_s,
                "min_requests": length.min_requests,
                "max_s": length.max_s,
                "max_in_flight": args.max_in_flight,
                "meta": str(meta_path),
                # chat
                "chat_url": chat_url,
                "chat_model": (stats.get("chat") or {}).get("model"),
            }
            before = monitor.scrape(url) if url else ""
            cpu0 = monitor.tree_cpu_s(srv.proc.pid) if srv else 0.0
            started = time.time()
            proc = _generator(point, url or chat_url or "", conf, prefix)
            total = length.max_s if args.run_time is not None or point.stages else None
            task = progress.add_task(f"{name} {point.label}", total=total)
            gen_cpu = 0.0
            try:
                while proc.poll() is None:
                    time.sleep(1)
                    gen_cpu = max(gen_cpu, monitor.tree_cpu_s(proc.pid))
                    done = _count_lines(records_path)
                    progress.update(
                        task,
                        completed=time.time() - started,
                        description=f"{name} {point.label}: {done} requests",
                    )
            finally:  # stopped early (SIGTERM, Ctrl-C): the generator stops too
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
            elapsed = time.time() - started
            if proc.returncode != 0 or not records_path.exists():
                raise RuntimeError(
                    f"{name} {point.label}: the generator exited {proc.returncode}; "
                    f"see {prefix}_generator.log"
                )
            cpu = {
                "generator": gen_cpu / elapsed,
                "service": (monitor.tree_cpu_s(srv.proc.pid) - cpu0) / elapsed if srv else None,
            }
            after = monitor.scrape(url) if url else ""
            meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
            csv_path = Path(f"{prefix}_stats.csv")
            run = report.run_summary(
                read_records(records_path.read_text()),
                before,
                after,
                load=point.label,
                users=point.users,
                rate=point.rate,
                slos_ms=slos,
                metric=metric,
                start=meta.get("t0"),
                cpu=cpu,
                locust_csv=csv_path.read_text() if csv_path.exists() else None,
            )
            if meta:
                run["open_loop"] = meta
            stats["runs"].append(run)
            if point.stages:
                stats["users_over_time"] = [(started, point.stages[0][1])] + [
                    (started + t, u) for (t, _), (_, u) in itertools.pairwise(point.stages)
                ]
    finally:
        if mon:
            mon.stop()
            stats["timeline"] = mon.timeline
        if srv:
            srv.stop()
            stats["replicas"] = server.read_replicas(srv.replicas_log)
    if name == "agent":
        stats["notes"].append(AGENT_NOTE)
    if name == "step" and not stats.get("replicas"):
        stats["notes"].append("No replica counts recorded (an existing deployment: --url).")
    report.write(stats, out)
    progress.log(f"{name}: wrote {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenarios", nargs="*", help=f"of {list(DESCRIPTIONS)} (default: all)")
    p.add_argument("--url", help="an existing deployment (default: start one on loopback)")
    p.add_argument(
        "--out",
        default=str(ROOT / "loadtest" / "results"),
        help="the folder the scenario folders go to (default: loadtest/results)",
    )
    p.add_argument(
        "--run-time",
        type=int,
        default=None,
        help="seconds per point, exactly (a short run, below the publishing rule); "
        "default: each point runs until it meets the rule (--min-run-time, --min-requests)",
    )
    p.add_argument(
        "--min-run-time",
        type=float,
        default=PUBLISH_MIN_S,
        help="without --run-time: seconds a point lasts at least (default %(default)s)",
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=PUBLISH_MIN_REQUESTS,
        help="without --run-time: requests a point has at least (default %(default)s); the "
        "report marks a point against the rule (60 s, 1000) whatever these say",
    )
    p.add_argument(
        "--max-run-time",
        type=float,
        default=7200,
        help="seconds a point may run to reach its requests (default %(default)s)",
    )
    p.add_argument(
        "--users", type=int, nargs="+", default=[1, 2, 4], help="user counts of the random scenario"
    )
    p.add_argument("--other-users", type=int, default=2, help="users of agent, cache_off, chat")
    p.add_argument(
        "--step",
        type=int,
        nargs=5,
        default=[1, 4, 15, 60, 80],
        metavar=("LOW", "HIGH", "T_LOW_END", "T_HIGH_END", "T_END"),
    )
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[0.25, 0.5],
        help="arrival rates (requests/s) of the open scenario (default %(default)s: about half "
        "and all of what the random mix gets through on 2 CPU cores)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=32,
        help="open loop: requests in flight at most; an arrival beyond is an overflow failure",
    )
    p.add_argument(
        "--slo-ms",
        type=float,
        nargs=2,
        metavar=("TIGHT", "LOOSE"),
        help="the two latency SLOs (ms) of every scenario run (default: per scenario, SLOS)",
    )
    p.add_argument(
        "--chat-url",
        help="chat: any OpenAI-compatible server's base URL, the part before "
        "/v1/chat/completions (default: the prefill application of --url or of the server "
        "started here, <url>/prefill); e.g. a vLLM server http://host:8001 or vitserve's vLLM "
        "front http://host:8000/vllm",
    )
    p.add_argument("--chat-model", help="chat: the model field (default: GET <chat-url>/v1/models)")
    p.add_argument("--chat-turns", type=int, default=4, help="chat: turns per conversation")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="server config (vitserve serve --set); for step, replaces its defaults",
    )
    args = p.parse_args(argv)
    args.scenarios = args.scenarios or list(DESCRIPTIONS)
    if bad := set(args.scenarios) - set(DESCRIPTIONS):
        p.error(f"unknown scenarios {sorted(bad)}")
    if args.slo_ms and not 0 < args.slo_ms[0] <= args.slo_ms[1]:
        p.error("--slo-ms takes TIGHT <= LOOSE, both > 0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # SIGTERM unwinds like Ctrl-C, so the server and the generator this run started stop too
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()) as prog:
            outs = [run_scenario(name, args, prog) for name in args.scenarios]
    finally:
        signal.signal(signal.SIGTERM, before)
    for o in outs:
        print(o / "report.md")
    return 0
