"""Where a run's CPU goes, by process role: a sampler `.ci/run` keeps running beside its steps.

On a 2-vCPU machine the suite is CPU-bound: a step's wall time is roughly the CPU its processes
burn over two, so cutting it means knowing *which* processes burn it (the pytest process, Ray's
raylet and agents, Serve's controller, the replicas' start-ups, vLLM's processes), not only which
tests are slow. The sampler reads every process's CPU time from /proc each ``--interval`` and
adds what each used since the last reading to its role (``role_of``: a Ray worker's title
``ray::ServeReplica:main:EncoderDeployment.initialize_and_get_metadata`` ->
``ServeReplica:EncoderDeployment.initialize_and_get_metadata``; a program by its name); every
``--every`` seconds it appends the running totals to a JSON-lines file. `.ci/run` appends a
marker line there when a step starts and ends (``{"t", "step", "event"}``). ``--page`` reads the
file back and writes, per foreground step, its wall time, the CPU all processes used, how busy
the cores were over the snapshots' span and the roles that used the most. ::

    python3 -m loadtest.cpu_by_role sample loadtest/results/durations/cpu.jsonl &
    python3 -m loadtest.cpu_by_role page loadtest/results/durations/cpu.jsonl \\
        --page loadtest/results/cpu-by-role.md

Standard library only (it runs before `make install` has made the venv).

Invariants:
- A process's CPU is counted from the first reading that sees it (a process already running
  when the sampler starts counts from then, not from its own start); what a process used after
  the last reading before it exited is lost (at most ``--interval`` of it).
- A process is charged to its role at each reading (a Ray worker is ``IDLE`` until it becomes
  an actor, then the actor's role): its CPU between two readings goes to its latest role.
- The totals a line carries only grow; a step's figures are the difference of the snapshots
  nearest its start and end markers, so they are as exact as ``--every``.
- The sampler stops on SIGTERM or SIGINT after writing one last line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
# programs known by one of their arguments (Ray's daemons, pytest under any interpreter)
BY_ARGUMENT = ("gcs_server", "raylet", "log_monitor.py", "monitor.py", "dashboard.py", "pytest")
TITLE = re.compile(r"^(ray::|VLLM::)(\S+)")


def role_of(cmdline: Sequence[str]) -> str:
    """A process's role from its command line: a Ray worker's or vLLM process's title without
    the application's name (``ray::ServeReplica:main:Ingress`` -> ``ServeReplica:Ingress``,
    ``ray::SERVE_REPLICA::main#Ingress#xyz:...`` alike), a Ray daemon or pytest by its
    argument, a Python module run with ``-m`` by its module, else the program's name."""
    if not cmdline:
        return "kernel or exited"
    first = cmdline[0]
    title = TITLE.match(first)
    if title:
        name = title.group(2)
        if name.startswith("SERVE_REPLICA::"):  # SERVE_REPLICA::app#Deployment#id:rest
            deployment = name.split("#")[1] if name.count("#") >= 2 else name
            return f"ServeReplica:{deployment} (starting)"
        parts = name.split(":")
        if parts[0] == "ServeReplica" and len(parts) >= 3:  # ServeReplica:app:Deployment.method
            return "ServeReplica:" + ":".join(parts[2:])
        return name
    for part in cmdline:
        base = Path(part).name
        if base in BY_ARGUMENT:
            return base
    if "-m" in cmdline[:-1]:
        return f"{Path(first).name} -m {cmdline[cmdline.index('-m') + 1]}"
    if "-c" in cmdline[:-1]:
        code = cmdline[cmdline.index("-c") + 1]
        if "multiprocessing" in code:
            return f"{Path(first).name} (multiprocessing child)"
        return f"{Path(first).name} -c"
    if len(cmdline) > 1 and Path(cmdline[1]).suffix == ".py":
        return f"{Path(first).name} {Path(cmdline[1]).name}"
    return Path(first).name


def read_processes(proc: Path = Path("/proc")) -> dict[tuple[int, int], tuple[str, float]]:
    """``{(pid, start tick): (role, CPU seconds)}`` of every process readable now."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
        args = [a for a in cmdline.split("\0") if a]
        out[(int(entry.name), int(fields[19]))] = (role_of(args), cpu)
    return out


class Sampler:
    """CPU seconds per role since the first reading (see the module's invariants)."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self._last: dict[tuple[int, int], float] | None = None

    def read(self, processes: dict[tuple[int, int], tuple[str, float]]) -> None:
        first = self._last is None
        last = self._last or {}
        for key, (role, cpu) in processes.items():
            before = cpu if first else last.get(key, 0.0)
            self.totals[role] += cpu - before
        self._last = {key: cpu for key, (_, cpu) in processes.items()}


def sample(out: Path, interval: float, every: float) -> None:
    sampler = Sampler()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    written = time.monotonic()
    with open(out, "a") as f:
        while True:
            sampler.read(read_processes())
            now = time.monotonic()
            if stop or now - written >= every:
                totals = {k: round(v, 2) for k, v in sampler.totals.items()}
                f.write(json.dumps({"t": time.time(), "cpu": totals}) + "\n")
                f.flush()
                written = now
            if stop:
                return
            time.sleep(interval)


@dataclass(frozen=True)
class StepCpu:
    step: str
    wall: float  # between its markers
    span: float  # between the snapshots its CPU is read from (what ``busy`` divides by)
    cpu: float
    roles: tuple[tuple[str, float], ...]  # most CPU first

    def busy(self, cores: int) -> float:
        return self.cpu / (self.span * cores) if self.span > 0 else 0.0


def steps_cpu(lines: Iterable[str]) -> list[StepCpu]:
    """Each step with a start and an end marker: the CPU between its nearest snapshots."""
    snapshots: list[tuple[float, dict[str, float]]] = []
    marks: dict[str, dict[str, float]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            if "step" in doc:
                marks.setdefault(doc["step"], {})[doc["event"]] = float(doc["t"])
            else:
                snapshots.append((float(doc["t"]), doc["cpu"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"line {n} is neither a snapshot nor a step marker: {exc}") from exc
    if not snapshots:
        return []

    def nearest(t: float) -> tuple[float, dict[str, float]]:
        return min(snapshots, key=lambda s: abs(s[0] - t))

    out = []
    for step, events in marks.items():
        if "start" not in events or "end" not in events:
            continue
        (ta, a), (tb, b) = nearest(events["start"]), nearest(events["end"])
        used = {role: cpu - a.get(role, 0.0) for role, cpu in b.items()}
        roles = sorted(((r, c) for r, c in used.items() if c > 0), key=lambda rc: (-rc[1], rc[0]))
        wall = events["end"] - events["start"]
        out.append(StepCpu(step, wall, tb - ta, sum(c for _, c in roles), tuple(roles)))
    return out


def page(steps: list[StepCpu], cores: int, top: int) -> str:
    lines = [
        "## CPU by process role, per `.ci/run` step",
        "",
        f"Sampled from /proc every second by `loadtest/cpu_by_role.py` on {cores} cores: each "
        "step's CPU is what *every* process on the machine used while it ran (background "
        "steps included), so a busy share under 100% is time the cores sat idle.",
        "",
        "| step | wall | CPU-s | busy | the roles that used the most (CPU-s) |",
        "|---|---|---|---|---|",
    ]
    for s in steps:
        roles = ", ".join(f"{r} {c:.0f}" for r, c in s.roles[:top] if c >= 0.5)
        lines.append(
            f"| `{s.step}` | {s.wall:.0f} s | {s.cpu:.0f} | {s.busy(cores):.0%} | {roles} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="sample until SIGTERM, appending snapshots to FILE")
    s.add_argument("file", type=Path)
    s.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    s.add_argument("--every", type=float, default=10.0, help="seconds between snapshot lines")
    p = sub.add_parser("page", help="per-step CPU by role from FILE, as markdown")
    p.add_argument("file", type=Path)
    p.add_argument("--page", type=Path, help="append the table to this page (else print it)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.command == "sample":
        sample(args.file, args.interval, args.every)
        return 0
    try:
        steps = steps_cpu(args.file.read_text().splitlines())
    except (OSError, ValueError) as exc:
        print(f"cpu_by_role: {args.file}: {exc}", file=sys.stderr)
        return 2
    text = page(steps, args.cores, args.top)
    if args.page:
        with open(args.page, "a") as f:
            f.write("\n" + text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
