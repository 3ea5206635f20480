"""What OpenMP's spin-wait costs the encoder's forward when it shares the cores (issue 38).

PyTorch's CPU kernels run on OpenMP threads (GNU libgomp in the pip wheels): at the end of each
parallel region a thread that has nothing left spins a while (``GOMP_SPINCOUNT``) before it
sleeps, betting that the next region starts soon. Alone on its cores the bet pays; beside other
processes it burns the CPU they wait for, and a thread preempted mid-region leaves its partner
spinning at the barrier. ``.ci/run`` runs the 64-images-at-2K row of the reliability table at
nice 19 beside its other steps, the worst case of that. ``OMP_WAIT_POLICY=PASSIVE`` makes a
waiting thread sleep at once.

Per trial, a fresh process (libgomp reads the policy when it starts) loads the demo model (the
row's model) with torch's threads on every core, prepares ``--images`` images of ``--side``
pixels, then times one ``EncoderEngine.run`` over them: its wall time and its own CPU time
(all threads, ``getrusage``). Setups (``--setups``):

* ``alone``: nothing else running;
* ``beside``: one busy core beside it (a Python loop), both at nice 0, as a replica beside
  its ingress;
* ``nice19``: the forward at nice 19 beside the busy core at nice 0, as ``.ci/run``'s
  background row beside a foreground step.

Each setup runs ``--rounds`` rounds of libgomp's default (the policy unset) then
``PASSIVE``, side by side; figures are medians over rounds. ::

    python loadtest/bench_omp_wait.py --out loadtest/results/omp-wait-cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: loadtest.*

from loadtest.bench_hot_path import machine
from loadtest.bench_vllm import git_state

POLICIES = {"default": None, "PASSIVE": "PASSIVE"}
SETUPS = {
    "alone": "nothing beside",
    "beside": "a busy core beside, both at nice 0",
    "nice19": "at nice 19, a busy core beside at nice 0",
}
HOG = "while True: pass"


@dataclass(frozen=True)
class Trial:
    """One forward's figures: its wall time and the CPU its process used meanwhile."""

    setup: str
    policy: str
    wall_s: float
    cpu_s: float


def child(images: int, side: int) -> None:
    """The measured process: print one JSON line ``{"wall_s", "cpu_s", "threads"}``."""
    import resource

    import torch

    from vitserve.deployments.common.serving import DEMO_FAMILY, DEMO_PRESET
    from vitserve.encoder.engine import EncoderEngine
    from vitserve.testing.images import make_image
    from vitserve.testing.models import cached_model

    engine = EncoderEngine.from_pretrained(
        str(cached_model(DEMO_FAMILY, DEMO_PRESET)), device="cpu", dtype="fp32"
    )
    prepared = [
        engine.prepare_one(make_image(side, side, seed=20_000 + i), i) for i in range(images)
    ]
    plan = engine.plan(prepared)

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cpu0, wall0 = cpu(), time.perf_counter()
    engine.run(prepared, plan)
    wall, used = time.perf_counter() - wall0, cpu() - cpu0
    print(json.dumps({"wall_s": wall, "cpu_s": used, "threads": torch.get_num_threads()}))


def trial(setup: str, policy: str, args: argparse.Namespace) -> Trial:
    """One child run in ``setup`` with ``policy``; the busy core (if any) stopped after."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if POLICIES[policy] is not None:
        env["OMP_WAIT_POLICY"] = POLICIES[policy]
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if setup != "alone" else None
    try:
        cmd = [sys.executable, __file__, "--child", str(args.images), str(args.side)]
        if setup == "nice19":
            cmd = ["nice", "-n", "19", *cmd]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if done.returncode != 0:
        raise RuntimeError(f"the measured process failed: {done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return Trial(setup, policy, got["wall_s"], got["cpu_s"])


def page(args: argparse.Namespace, trials: list[Trial], started: str) -> list[str]:
    """The results page: per setup and policy, median wall and CPU, PASSIVE over default."""
    med = {
        (s, p): (
            statistics.median(t.wall_s for t in trials if (t.setup, t.policy) == (s, p)),
            statistics.median(t.cpu_s for t in trials if (t.setup, t.policy) == (s, p)),
        )
        for s in args.setups
        for p in POLICIES
    }
    lines = [
        "# OpenMP's spin-wait and the encoder's forward on shared cores (CPU)",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in machine().items()),
        "",
        f"Commit {git_state()}, run {started}. Command: `python loadtest/bench_omp_wait.py "
        f"--images {args.images} --side {args.side} --rounds {args.rounds} "
        f"--setups {' '.join(args.setups)}`.",
        "",
        f"One `EncoderEngine.run` of the demo model (fp32, torch's threads on all "
        f"{os.cpu_count()} cores) over {args.images} images of {args.side} px, in a fresh "
        "process per trial; `default` leaves `OMP_WAIT_POLICY` unset (libgomp spins before it "
        f"sleeps), `PASSIVE` sets it. Medians over {args.rounds} rounds, the two policies "
        "alternating.",
        "",
        "| setup | default wall (s) | default CPU (s) | PASSIVE wall (s) | PASSIVE CPU (s) "
        "| PASSIVE / default wall | PASSIVE / default CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in args.setups:
        (dw, dc), (pw, pc) = med[(s, "default")], med[(s, "PASSIVE")]
        lines.append(
            f"| {SETUPS[s]} | {dw:.1f} | {dc:.1f} | {pw:.1f} | {pc:.1f} | {pw / dw:.2f}x "
            f"| {pc / dc:.2f}x |"
        )
    lines += ["", "Every trial (setup, policy, wall s, CPU s):", ""]
    lines += [f"- {t.setup}, {t.policy}: {t.wall_s:.2f}, {t.cpu_s:.2f}" for t in trials]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, type=int, metavar=("IMAGES", "SIDE"))
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--side", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    trials = []
    for setup in args.setups:
        for _ in range(args.rounds):
            for policy in POLICIES:
                trials.append(trial(setup, policy, args))
                print(trials[-1], flush=True)
    lines = page(args, trials, started)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
