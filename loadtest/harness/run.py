"""Run the scenarios: start a server (unless ``--url``), run locust headless per user count,
scrape /metrics, write ``loadtest/results/<scenario>-<timestamp>/``.

    python -m loadtest.harness [random agent cache_off step] [--run-time 25] [--users 1 2 4]
        [--url http://host:8000] [--set encoder.autoscaling.max_replicas=2 ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.harness import monitor, report, server

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
}
AGENT_NOTE = (
    "The SDK probes keys first (POST /v1/probe) and uploads only the new image, so the "
    "re-sent images never reach the ingress's store lookup: the service's hit rate stays ~0; "
    "the reuse shows as images sent (images/s) vs images encoded."
)
# Autoscaling on work (vitserve.deployments.encoder.autoscaling) on the embedded default (2 CPUs:
# ingress + encoders of 0.5 CPU each), short delays so the step shows both directions, unless
# --set overrides.
STEP_SET = [
    "encoder.autoscaling.policy=work",
    "encoder.autoscaling.min_replicas=1",
    "encoder.autoscaling.max_replicas=2",
    "encoder.autoscaling.target_queue_delay_s=2",
    "encoder.autoscaling.upscale_delay_s=1",
    "encoder.autoscaling.downscale_delay_s=8",
    "encoder.num_cpus=0.5",
]


def _locust(
    url: str, conf: dict[str, Any], users: int, run_time: int, prefix: Path, shape: bool
) -> subprocess.Popen:
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
        "--stop-timeout",
        "30",
        "--loglevel",
        "WARNING",
    ]
    if not shape:
        args += ["-u", str(users), "-r", str(users), "--run-time", f"{run_time}s"]
    env = dict(os.environ, LOADTEST_CONF=json.dumps(conf), PYTHONPATH=str(ROOT))
    log = open(f"{prefix}_locust.log", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def run_scenario(name: str, args: argparse.Namespace, progress: Any) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = ROOT / "loadtest" / "results" / f"{name}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    srv = None
    url = args.url
    extra = [f for s in (args.set or []) for f in ("--set", s)]
    if name == "step" and not args.set:
        extra = [f for s in STEP_SET for f in ("--set", s)]
    if not url:
        from vitserve.deployments.runner.local import free_port

        srv = server.Server(free_port(), extra, out)
        progress.log(f"{name}: starting vitserve serve {' '.join(extra)}")
        srv.wait_ready()
        url = srv.url
    stats: dict[str, Any] = {
        "scenario": name,
        "description": DESCRIPTIONS[name],
        "started": stamp,
        "server": {"url": url, "flags": extra},
        "generator": "locust (headless, 1 process)",
        "runs": [],
        "timeline": [],
        "notes": [],
    }
    try:
        from loadtest.bench_hot_path import machine

        stats["machine"] = machine()
    except Exception as exc:
        stats["machine"] = {"error": repr(exc)}
    mon = monitor.Monitor(url)
    mon.start()
    users_list = args.users if name == "random" else [args.other_users]
    stages = None
    if name == "step":
        lo, hi, t1, t2, t3 = args.step
        stages = [[t1, lo], [t2, hi], [t3, lo]]
        users_list = [f"{lo}->{hi}->{lo}"]
    try:
        for i, users in enumerate(users_list):
            conf = {
                "scenario": name,
                "seed": i + 1,
                "run_id": f"{stamp}-{i}",
                "k_min": 1,
                "k_max": 4,
                "duplicate_ratio": 0.3,
                "turns": 6,
                "stages": stages,
            }
            prefix = out / f"locust_u{users}".replace(">", "").replace("-", "_")
            run_time = stages[-1][0] if stages else args.run_time
            before = monitor.scrape(url)
            cpu0 = monitor.tree_cpu_s(srv.proc.pid) if srv else 0.0
            started = time.time()
            proc = _locust(
                url, conf, users if isinstance(users, int) else 0, run_time, prefix, bool(stages)
            )
            task = progress.add_task(f"{name} users={users}", total=run_time)
            gen_cpu = 0.0
            while proc.poll() is None:
                time.sleep(1)
                gen_cpu = max(gen_cpu, monitor.tree_cpu_s(proc.pid))
                progress.update(task, completed=min(time.time() - started, run_time))
            elapsed = time.time() - started
            cpu = {
                "generator": gen_cpu / elapsed,
                "service": (monitor.tree_cpu_s(srv.proc.pid) - cpu0) / elapsed if srv else None,
            }
            after = monitor.scrape(url)
            csv_path = Path(f"{prefix}_stats.csv")
            if not csv_path.exists():
                raise RuntimeError(f"locust wrote no stats; see {prefix}_locust.log")
            run = report.run_summary(
                csv_path.read_text(), before, after, users=users, duration_s=elapsed, cpu=cpu
            )
            stats["runs"].append(run)
            if stages:
                stats["users_over_time"] = [(started, stages[0][1])] + [
                    (started + t, u) for (t, _), (_, u) in itertools.pairwise(stages)
                ]
    finally:
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
    progress.log(f"{name}: wrote {out.relative_to(ROOT)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("scenarios", nargs="*", help=f"of {list(DESCRIPTIONS)} (default: all)")
    p.add_argument("--url", help="an existing deployment (default: start one on loopback)")
    p.add_argument("--run-time", type=int, default=25, help="seconds per locust run")
    p.add_argument(
        "--users", type=int, nargs="+", default=[1, 2, 4], help="user counts of the random scenario"
    )
    p.add_argument("--other-users", type=int, default=2, help="users of agent and cache_off")
    p.add_argument(
        "--step",
        type=int,
        nargs=5,
        default=[1, 4, 15, 60, 80],
        metavar=("LOW", "HIGH", "T_LOW_END", "T_HIGH_END", "T_END"),
    )
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
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()) as prog:
        outs = [run_scenario(name, args, prog) for name in args.scenarios]
    for o in outs:
        print(o / "report.md")
    return 0
