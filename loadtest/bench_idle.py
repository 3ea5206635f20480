"""What the embedded cluster costs the encoder's forward while it is idle (issue 40, item 2).

On a small host the encoder's forward shares the cores with the processes of the embedded
default (Ray's GCS, raylet, agents and monitors; Serve's controller, proxy and replicas;
vitserve's own actors), and each time one of them wakes it can stall the forward's threads.
This measures, one setup at a time (``--blocks``, e.g. ``NDQQDN``):

* ``N``: nothing beside the benchmark;
* ``D``: ``vitserve serve`` with Ray's and Serve's own timer defaults (the benchmark sets them
  in the server's environment: an operator's setting wins over vitserve's);
* ``Q``: ``vitserve serve`` as shipped (``vitserve.deployments.runner.quiet``).

Per block: the server started (its start-up timed) and left idle ``--settle`` seconds; then
each of its processes' CPU and context switches (all threads, /proc) over ``--seconds``; then
``--forwards`` forwards of the model's tower by vitserve's ``EncoderEngine`` in this process
(torch threads on all cores, a new image each, ``--gap`` idle before each; the forward is
timed without the decode and image processor); then the server is stopped. Figures: medians
over a setup's blocks. ::

    RAY_AUTH_MODE=disabled python loadtest/bench_idle.py --out loadtest/results/idle-cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine
from loadtest.bench_vllm import VitserveServer, engine_probe, git_state
from vitserve.deployments.runner.local import free_port
from vitserve.deployments.runner.quiet import QUIET_ENV, RAY_DEFAULTS

SETUPS = {"N": "nothing beside", "D": "Ray's timer defaults", "Q": "vitserve as shipped"}


def role(proc: psutil.Process) -> str:
    """A process's role, from its title (``ray::ServeController.listen_for_change`` ->
    ``ServeController``) or its program (``gcs_server``, ``dashboard.py``)."""
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0][5:].split(".")[0].split(" ")[0]
    for part in cmd:
        name = Path(part).name
        if name.endswith(".py") or name in ("gcs_server", "raylet"):
            return name
        if name == "vitserve":
            return "vitserve serve (driver)"
    return Path(cmd[0]).name if cmd else proc.name()


def switches(pid: int) -> int:
    """Context switches (voluntary + not) of every thread of ``pid``: its wakeups, near enough."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def snapshot(root: int) -> dict[int, tuple[str, float, int]]:
    out = {}
    top = psutil.Process(root)
    for proc in [top, *top.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, FileNotFoundError):
            t = proc.cpu_times()
            out[proc.pid] = (role(proc), t.user + t.system, switches(proc.pid))
    return out


def idle_by_role(root: int, seconds: float) -> dict[str, tuple[float, float]]:
    """``{role: (cores, switches per second)}`` of ``root``'s tree over ``seconds``."""
    before = snapshot(root)
    time.sleep(seconds)
    after = snapshot(root)
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pid, (name, cpu, cs) in after.items():
        if pid in before:
            acc[name][0] += (cpu - before[pid][1]) / seconds
            acc[name][1] += (cs - before[pid][2]) / seconds
    return {k: (v[0], v[1]) for k, v in acc.items()}


@dataclass
class Block:
    setup: str
    startup_s: float = 0.0
    roles: dict[str, tuple[float, float]] = field(default_factory=dict)
    forward: list[float] = field(default_factory=list)


def run_block(setup: str, k: int, args: argparse.Namespace, model: Path, logs: Path) -> Block:
    block = Block(setup)
    seeds = [900_000 + 1000 * k + i for i in range(args.forwards)]
    with contextlib.ExitStack() as stack:
        if setup != "N":
            env = dict(RAY_DEFAULTS) if setup == "D" else {}
            server = VitserveServer(
                args.vitserve,
                model,
                "node://",
                free_port(),
                [],
                str(logs / f"vitserve-{k}{setup}.log"),
                env=env,
            )
            t0 = time.monotonic()
            stack.enter_context(server)
            block.startup_s = time.monotonic() - t0
            time.sleep(args.settle)
            assert server.proc is not None
            block.roles = idle_by_role(server.proc.pid, args.seconds)
        block.forward = engine_probe(model, seeds, args.gap)["forward"]
    cores = sum(c for c, _ in block.roles.values())
    wakes = sum(w for _, w in block.roles.values())
    print(
        f"  {k}{setup} {SETUPS[setup]:<22} start-up {block.startup_s:5.1f} s  idle "
        f"{cores:.3f} cores {wakes:6.0f} switches/s  forward p50 "
        f"{statistics.median(block.forward) * 1e3:.1f} ms",
        flush=True,
    )
    return block


def med(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def page(args: argparse.Namespace, blocks: list[Block], model: Path, started: str) -> list[str]:
    by = {s: [b for b in blocks if b.setup == s] for s in SETUPS}
    base = med([med(b.forward) for b in by["N"]])
    lines = [
        "# The embedded cluster's idle cost to the encoder's forward (CPU)",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in machine().items()),
        "",
        f"Commit {git_state()}, run {started}. Command: `python loadtest/bench_idle.py "
        + " ".join(sys.argv[1:])
        + "`.",
        "",
        f"Model: `{model.name}` (fp32, `--dtype fp32 --device cpu`), the embedded default "
        "(`vitserve serve`: local Ray, node store, no vLLM front). Blocks in order: "
        f"{args.blocks}; per block the server idle {args.settle:.0f} s, its processes sampled "
        f"over {args.seconds:.0f} s, then {args.forwards} forwards in the benchmark's process "
        f"({args.gap} s idle before each). *D* sets, in the server's environment, Ray's and "
        "Serve's own values of every timer vitserve sets: "
        + ", ".join(f"`{k}={v}`" for k, v in RAY_DEFAULTS.items())
        + "; *Q* runs with vitserve's: "
        + ", ".join(f"`{k}={v}`" for k, v in QUIET_ENV.items())
        + ".",
        "",
        "| setup | blocks | start-up (s) | idle cores | switches/s | forward p50 (ms) | "
        "vs nothing beside | per block (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, name in SETUPS.items():
        if not by[s]:
            continue
        cores = med([sum(c for c, _ in b.roles.values()) for b in by[s]])
        wakes = med([sum(w for _, w in b.roles.values()) for b in by[s]])
        fwd = med([med(b.forward) for b in by[s]])
        start = med([b.startup_s for b in by[s]])
        lines.append(
            f"| {name} | {len(by[s])} | {start:.1f} | {cores:.3f} | {wakes:.0f} | "
            f"{fwd * 1e3:.1f} | {fwd / base:.3f}x | "
            + ", ".join(f"{med(b.forward) * 1e3:.1f}" for b in by[s])
            + " |"
        )
    if by["D"] and by["Q"] and by["N"]:
        cores = {s: med([sum(c for c, _ in b.roles.values()) for b in by[s]]) for s in "DQ"}
        wakes = {s: med([sum(w for _, w in b.roles.values()) for b in by[s]]) for s in "DQ"}
        fwd = {s: med([med(b.forward) for b in by[s]]) for s in "DQ"}
        alone = [med(b.forward) for b in by["N"]]
        spread = (max(alone) - min(alone)) / base
        lines += [
            "",
            f"vitserve's timers: the idle cluster's CPU {cores['D']:.3f} -> {cores['Q']:.3f} "
            f"cores ({cores['Q'] / cores['D'] - 1:+.0%}), its context switches "
            f"{wakes['D']:.0f} -> {wakes['Q']:.0f} per second "
            f"({wakes['Q'] / wakes['D'] - 1:+.0%}). The forward beside the idle cluster: "
            f"{fwd['D'] / base:.3f}x (Ray's timers) and {fwd['Q'] / base:.3f}x (vitserve's) "
            f"the forward with nothing beside, whose own blocks differ by {spread:.1%}.",
        ]
    roles = sorted(
        {r for b in blocks for r in b.roles},
        key=lambda r: -med([b.roles[r][0] for b in by["D"] if r in b.roles] or [0.0]),
    )
    lines += [
        "",
        "Each process of the server while idle (median over blocks; cores, context switches "
        "per second over all its threads):",
        "",
        "| process | D cores | D switches/s | Q cores | Q switches/s |",
        "|---|---|---|---|---|",
    ]
    for r in roles:
        cells = []
        for s in "DQ":
            got = [b.roles[r] for b in by[s] if r in b.roles]
            cells += [f"{med([g[0] for g in got]):.4f}", f"{med([g[1] for g in got]):.0f}"]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="qwen2_vl test-model preset (vllm)")
    parser.add_argument("--blocks", default="NDQQDN", help="setup order (N, D, Q)")
    parser.add_argument("--forwards", type=int, default=8)
    parser.add_argument("--gap", type=float, default=1.1, help="idle seconds before a forward")
    parser.add_argument("--settle", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--vitserve", default=str(Path(sys.executable).parent / "vitserve"))
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench-idle"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if set(args.blocks) - set(SETUPS):
        parser.error(f"--blocks takes letters of {''.join(SETUPS)}")
    from vitserve.testing.models import cached_model

    model = cached_model("qwen2_vl", args.preset, vllm=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    blocks = [run_block(s, k, args, model, args.logs) for k, s in enumerate(args.blocks)]
    lines = page(args, blocks, model, started)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
