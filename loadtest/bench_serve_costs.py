"""What Ray Serve's own processes cost on this machine, the inputs the capacity model scales:

* **the proxy's CPU per request**: sequential HTTP POSTs (a multipart body of each size) through
  the proxy to a trivial FastAPI deployment that reads the body and answers; the proxy's (and
  the replica's and controller's) process CPU over the requests, per request;
* **the controller's CPU per replica**: the controller's CPU per second with ``1`` and then
  ``--replicas`` idle replicas of a trivial deployment (Serve's own autoscaling metrics on, as
  vitserve's deployments run them), the slope per replica.

Process CPU is read from ``/proc/<pid>/stat`` of the processes Ray names (``ray::ProxyActor``,
``ray::ServeController``, ``ray::ServeReplica:...``)::

    RAY_AUTH_MODE=disabled python loadtest/bench_serve_costs.py \\
        --out loadtest/results/serve-costs-cpu.md
"""

# No ``from __future__ import annotations``: FastAPI reads the handler's annotations.
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine

TICK = os.sysconf("SC_CLK_TCK")
app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
@serve.ingress(app)
class Echo:
    @app.post("/")
    async def post(self, request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"bytes": len(body)})


def cpu_seconds(match: str) -> float:
    """CPU seconds used so far by the processes whose command line holds ``match``."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if match not in cmdline:
                continue
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return total


def per_request(url: str, body_bytes: int, n: int) -> dict[str, float]:
    parts = ("ray::ProxyActor", "ray::ServeController", "ray::ServeReplica:costs:Echo")
    data = os.urandom(body_bytes)
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(20):
            client.post(url, files=[("images", ("i.jpg", data, "image/jpeg"))])
        before = {p: cpu_seconds(p) for p in parts}
        for _ in range(n):
            started = time.perf_counter()
            client.post(url, files=[("images", ("i.jpg", data, "image/jpeg"))]).raise_for_status()
            times.append(time.perf_counter() - started)
        after = {p: cpu_seconds(p) for p in parts}
    out = {p.split(":")[-1]: (after[p] - before[p]) / n * 1e3 for p in parts}
    out["p50_ms"] = statistics.median(times) * 1e3
    return out


def controller_per_second(seconds: float) -> float:
    before, started = cpu_seconds("ray::ServeController"), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds("ray::ServeController") - before) / (time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 81920])
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from vitserve.deployments.runner.local import free_port, serve_app, start_ray, start_serve

    start_ray(num_cpus=4)
    base = start_serve("127.0.0.1", free_port())
    autoscaling = {"min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 1.0}
    serve_app(Echo.options(autoscaling_config=autoscaling).bind(), name="costs", route_prefix="/c")
    rows = [(size, per_request(f"{base}/c/", size, args.requests)) for size in args.sizes]
    idle = {1: controller_per_second(args.idle_s)}
    many = {**autoscaling, "min_replicas": args.replicas, "max_replicas": args.replicas}
    serve_app(Echo.options(autoscaling_config=many).bind(), name="costs", route_prefix="/c")
    time.sleep(5)  # the new replicas up and reporting
    idle[args.replicas] = controller_per_second(args.idle_s)
    serve.shutdown()
    per_replica = (idle[args.replicas] - idle[1]) / (args.replicas - 1)
    lines = [
        "# Ray Serve's own costs per request and per replica (CPU)",
        "",
        f"Machine: {'; '.join(f'{k}: {v}' for k, v in machine().items())}",
        "",
        f"Command: `python loadtest/bench_serve_costs.py {' '.join(sys.argv[1:])}`",
        "",
        f"{args.requests} sequential POSTs per body size (multipart, one file part) through "
        "Serve's HTTP proxy to a trivial FastAPI deployment that reads the body; each process's "
        "CPU (user + system, /proc) over them, per request:",
        "",
        "| body (bytes) | HTTP p50 (ms) | proxy CPU (ms) | replica CPU (ms) | "
        "controller CPU (ms) |",
        "|---|---|---|---|---|",
        *(
            f"| {size:,} | {r['p50_ms']:.1f} | {r['ProxyActor']:.2f} | {r['Echo']:.2f} | "
            f"{r['ServeController']:.2f} |"
            for size, r in rows
        ),
        "",
        f"The controller idle, Serve's autoscaling metrics every second: {idle[1] * 1e3:.1f} ms "
        f"CPU per second with 1 replica, {idle[args.replicas] * 1e3:.1f} with {args.replicas}: "
        f"**{per_replica * 1e3:.2f} ms per second per replica** ({args.idle_s:.0f} s each).",
        "",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
