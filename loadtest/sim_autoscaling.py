"""Simulate the encoder pool under the work policy and under the request-count policy, with
vitserve's router and with Serve's.

A time-stepped model (``DT`` s): requests of mixed sizes arrive (Poisson); a replica works off
``P`` patches/s, its queue in FIFO. Routers:

* ``serve-default``: Serve's power of two choices on ongoing requests; each request waits at
  the replica it was sent to;
* ``work``: vitserve's router, :class:`vitserve.deployments.encoder.routing.WorkRouting` itself,
  fed each replica's queued patches and room (``ROOM``): a request goes to a replica with room
  (by load; every request is a new image, so its key's owner is a random replica, kept while
  within the bound), and while none has room it waits in the router, oldest first, for at most
  the router's ``hold_s``; then it goes to the least loaded replica (this model has no
  admission to refuse it there: it queues).

A new replica is ready ``STARTUP_S`` after it is asked for. Every ``TICK_S`` the autoscaler
sees the metrics averaged over ``LOOK_BACK_S`` and decides:

* work: :func:`vitserve.deployments.encoder.autoscaling.decide` itself, fed what the replicas
  report (queued + running patches, patches per busy second, busy fraction over the last 10 s,
  mean patches per call) and the count of calls waiting in the router;
* requests: Serve's request-count policy as vitserve's ``policy: requests`` configures it
  (``target_ongoing_requests`` 8, not Serve's default 2; the same delays as the work policy,
  not Serve's default 30 s / 600 s): desired = ceil(ongoing requests, those waiting in the
  router included / target_ongoing_requests), a change applied once wanted for its delay,
  clamped.

Queue delay = the time from a request's arrival to the start of its work. Writes
``loadtest/results/autoscaling-sim.md`` and ``.png``::

    python loadtest/sim_autoscaling.py
"""

from __future__ import annotations

import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from vitserve.deployments.encoder.autoscaling import WorkParams, WorkStats, decide
from vitserve.deployments.encoder.routing import (
    ADMITTED_PATCHES,
    DEFAULT_HOLD_S,
    ROOM_PATCHES,
    RouteHint,
    WorkRouting,
)

P = 100_000.0  # patches/s of one replica (a GPU tower of about ViT-L size)
DT, TICK_S, LOOK_BACK_S, STARTUP_S, WINDOW_S = 0.05, 0.5, 3.0, 5.0, 10.0
MIN_REPLICAS, MAX_REPLICAS = 1, 8
#: The room a replica reports to the work router: two full forwards (one running, one ready),
#: a forward here taking 0.25 s of a replica.
ROOM = int(2 * 0.25 * P)
DURATION_S = 360.0
TARGET_QUEUE_DELAY_S, UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 2.0, 5.0, 60.0
TARGET_ONGOING_REQUESTS = 8.0  # vitserve's default for the request policy

# Request kinds: (name, patches, share of the patch load). Qwen2-VL patch counts: a 224px
# thumbnail is 16x16 = 256 patches, a 1280x720 frame 52x92 = 4784, a clip 32 such frames.
KINDS = [("thumbnail", 256, 1 / 3), ("frame_720p", 4784, 1 / 3), ("clip_32x720p", 32 * 4784, 1 / 3)]


@dataclass
class Replica:
    ready_at: float
    name: str = ""
    queue: deque = field(default_factory=deque)  # [remaining patches, arrival, started, key]
    pending: float = 0.0  # the queue's remaining patches (kept, not summed each time)
    done: deque = field(default_factory=deque)  # (time, patches done in that step)
    # the patches done in the window, kept, not summed each step: whole numbers (P * DT and
    # every call's patches are), so the running sum is exact
    done_sum: float = 0.0

    def backlog(self) -> float:
        return self.pending

    def busy_s(self) -> float:
        """The seconds it worked in the window."""
        return self.done_sum / P

    def put(self, call: list) -> None:
        self.queue.append(call)
        self.pending += call[0]


def step_load(t: float) -> float:
    """Offered patches/s: 0.3 P, a step to 2.5 P for 120 s, back to 0.3 P."""
    return (2.5 if 20 <= t < 140 else 0.3) * P


def sawtooth_load(t: float) -> float:
    """Offered patches/s: three 60 s ramps from 0.2 P to 3 P, then 0.2 P."""
    if t >= 180:
        return 0.2 * P
    return (0.2 + 2.8 * (t % 60) / 60) * P


@dataclass
class Run:
    times: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    delay: list[float] = field(default_factory=list)  # a new request's wait, if routed now
    waits: list[tuple[float, float]] = field(default_factory=list)  # (arrival, wait)
    replica_seconds: float = 0.0


ROUTERS = ("work", "serve-default")


def simulate(
    load, policy: str, duration: float = DURATION_S, seed: int = 0, router: str = "serve-default"
) -> Run:
    rng = random.Random(seed)  # arrivals: the same for every policy and router
    pick = random.Random(seed + 1)  # the power of two choices' picks
    names = (f"replica-{i}" for i in range(10**6))
    replicas = [Replica(ready_at=0.0, name=next(names))]
    routing = WorkRouting()
    requests = 0
    held: deque = deque()  # the work router's calls waiting for a replica with room
    calls: deque = deque()  # (time, patches) of the calls replicas admitted: CALL_PATCHES
    calls_sum = 0.0  # their patches (whole numbers: an exact running sum)
    target, state, samples = 1, {}, deque()
    req_state: dict = {}
    run = Run()
    params = WorkParams(
        TARGET_QUEUE_DELAY_S, UPSCALE_DELAY_S, DOWNSCALE_DELAY_S, MIN_REPLICAS, MAX_REPLICAS
    )
    next_tick, t = 0.0, 0.0
    while t < duration:
        ready = [r for r in replicas if r.ready_at <= t]
        # arrivals
        for _name, patches, share in KINDS:
            rate = load(t) * share / patches
            for _ in range(_poisson(rng, rate * DT)):
                requests += 1
                call = [float(patches), t, False, f"image-{seed}-{requests}"]
                if router == "work":
                    held.append(call)
                    continue
                a, b = pick.choice(ready), pick.choice(ready)
                r = a if len(a.queue) <= len(b.queue) else b
                r.put(call)
                calls.append((t, patches))
                calls_sum += patches
        # the work router: the waiting calls, oldest first, each to a replica with room
        while held:
            by_name = {r.name: r for r in ready}
            routing.reported(
                {n: {ADMITTED_PATCHES: r.backlog(), ROOM_PATCHES: ROOM} for n, r in by_name.items()}
            )
            call_hint = RouteHint((held[0][3],), (int(held[0][0]),))
            order = routing.choose(call_hint, list(by_name), waited_s=t - held[0][1])
            if not order:
                break
            call = held.popleft()
            by_name[order[0]].put(call)
            calls.append((t, call[0]))
            calls_sum += call[0]
        # work
        for r in ready:
            budget, used = P * DT, 0.0
            while r.queue and budget > 0:
                head = r.queue[0]
                if not head[2]:
                    head[2] = True
                    run.waits.append((head[1], t + used / P - head[1]))
                take = min(head[0], budget)
                head[0] -= take
                r.pending -= take
                budget -= take
                used += take
                if head[0] <= 0:
                    r.queue.popleft()
            if used:
                r.done.append((t, used))
                r.done_sum += used
            while r.done and r.done[0][0] < t - WINDOW_S:
                r.done_sum -= r.done.popleft()[1]
        # metrics a replica would report now, and what waits in the router (the work policy
        # counts it at the mean patches of the calls the replicas admitted, as Serve's context
        # gives it the count only)
        while calls and calls[0][0] < t - WINDOW_S:
            calls_sum -= calls.popleft()[1]
        call_patches = calls_sum / len(calls) if calls else 0.0
        samples.append(
            (
                t,
                sum(r.backlog() for r in ready) + len(held) * call_patches,
                _tput(ready),
                sum(r.busy_s() / WINDOW_S for r in ready),
                sum(len(r.queue) for r in ready) + len(held),
            )
        )
        while samples[0][0] < t - LOOK_BACK_S:
            samples.popleft()
        if t >= next_tick:
            next_tick += TICK_S
            n = len(samples)
            backlog = sum(s[1] for s in samples) / n
            rates = [s[2] for s in samples if s[2]]
            busy = sum(s[3] for s in samples) / n
            ongoing = sum(s[4] for s in samples) / n
            if policy == "work":
                stats = WorkStats(target, backlog, sum(rates) / len(rates) if rates else None, busy)
                target, state = decide(stats, state, params, t)
            else:
                target, req_state = _request_policy(ongoing, target, req_state, t)
            while len(replicas) < target:
                replicas.append(Replica(ready_at=t + STARTUP_S, name=next(names)))
            while len(replicas) > target:  # drop the emptiest (Serve drains before stopping)
                victim = min(replicas, key=Replica.backlog)
                replicas.remove(victim)
                others = [r for r in replicas if r.ready_at <= t] or replicas
                for item in victim.queue:  # its queued work finishes elsewhere
                    min(others, key=Replica.backlog).put(item)
        run.times.append(t)
        run.replicas.append(len(replicas))
        if router == "work":  # one queue in front of the pool
            waiting = sum(r.backlog() for r in ready) + sum(h[0] for h in held)
            run.delay.append(waiting / (len(ready) * P))
        else:
            run.delay.append(min(r.backlog() for r in ready) / P)
        run.replica_seconds += len(replicas) * DT
        t += DT
    return run


def _tput(ready: list[Replica]) -> float | None:
    rates = [r.done_sum / r.busy_s() for r in ready if r.done]
    return sum(rates) / len(rates) if rates else None


def _request_policy(ongoing: float, target: int, st: dict, now: float) -> tuple[int, dict]:
    """Serve's request-count policy and delay logic (ray.serve.autoscaling_policy, 2.60)."""
    desired = min(max(math.ceil(ongoing / TARGET_ONGOING_REQUESTS), MIN_REPLICAS), MAX_REPLICAS)
    direction = (desired > target) - (desired < target)
    if direction == 0:
        return target, {}
    since = st["since"] if st.get("direction") == direction else now
    delay = UPSCALE_DELAY_S if direction > 0 else DOWNSCALE_DELAY_S
    if now - since + 1e-9 >= delay:
        return desired, {}
    return target, {"direction": direction, "since": since}


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def summarize(
    runs: list[Run], busy_from: float, settled_from: float, busy_to: float
) -> dict[str, float]:
    """Over the requests of all ``runs`` (one per seed) arriving in [busy_from, busy_to) (the
    transient included) and in [settled_from, busy_to) (after the first reaction): the peak
    (max) and p95 queue delay; and per run (the mean over runs) the replica-seconds, the
    largest pool (the max) and the pool at the end (the max)."""

    def waits(lo: float) -> list[float]:
        return sorted(w for run in runs for a, w in run.waits if lo <= a < busy_to) or [0.0]

    every, settled = waits(busy_from), waits(settled_from)
    return {
        "peak_delay_s": every[-1],
        "p95_delay_s": every[int(0.95 * (len(every) - 1))],
        "settled_peak_delay_s": settled[-1],
        "replica_seconds": sum(run.replica_seconds for run in runs) / len(runs),
        "max_replicas": max(max(run.replicas) for run in runs),
        "final_replicas": max(run.replicas[-1] for run in runs),
    }


#: load -> (offered patches/s at t, load from, settled from, load until)
LOADS = {"step": (step_load, 20.0, 50.0, 140.0), "sawtooth": (sawtooth_load, 0.0, 60.0, 180.0)}
#: The arrivals simulated (one run per seed, the same arrivals for every policy and router):
#: one seed's p95 swings by 2-4x with where its few clips land, so figures pool five.
SEEDS = (0, 1, 2, 3, 4)
POLICIES = ("work", "requests")


@dataclass
class Result:
    runs: list[Run]  # one per seed
    pooled: dict[str, float]  # summarize() over all of them
    per_seed: list[dict[str, float]]


def run_all(
    duration: float = DURATION_S,
    seeds=SEEDS,
    configs: tuple[tuple[str, str], ...] = tuple((p, r) for p in POLICIES for r in ROUTERS),
) -> dict[tuple[str, str, str], Result]:
    """Every (load, policy, router) of ``configs``, over the same arrivals (seeds) for each."""
    out = {}
    for load_name, (load, lo, settled, hi) in LOADS.items():
        for policy, router in configs:
            runs = [simulate(load, policy, duration, seed, router) for seed in seeds]
            out[load_name, policy, router] = Result(
                runs,
                summarize(runs, lo, settled, hi),
                [summarize([r], lo, settled, hi) for r in runs],
            )
    return out


def write_report(results: dict[tuple[str, str, str], Result], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Autoscaling simulation: work policy and router vs request-count policy and Serve's "
        "router",
        "",
        f"Generated by `loadtest/sim_autoscaling.py`. One replica works off P = {P:,.0f} "
        f"patches/s; a new replica is ready {STARTUP_S:g} s after it is asked for; min "
        f"{MIN_REPLICAS}, max {MAX_REPLICAS} replicas; upscale delay {UPSCALE_DELAY_S:g} s, "
        f"downscale delay {DOWNSCALE_DELAY_S:g} s (both policies); metrics averaged over "
        f"{LOOK_BACK_S:g} s, a decision every {TICK_S:g} s. Work policy "
        "(`vitserve.deployments.encoder.autoscaling.decide`): target queue delay "
        f"{TARGET_QUEUE_DELAY_S:g} s. Request policy (vitserve's `requests`: Serve's "
        "request-count policy): "
        f"target_ongoing_requests {TARGET_ONGOING_REQUESTS:g}, counting the calls waiting in "
        "the router as Serve does. Routers: `work` is vitserve's "
        "(`vitserve.deployments.encoder.routing.WorkRouting`): a replica takes calls while "
        f"its queued patches are below its room ({ROOM:,} patches, two forwards), the rest "
        "wait in the router, oldest first, for the first replica with room, each for at most "
        f"the router's hold ({DEFAULT_HOLD_S:g} s), then go to the least loaded replica (this "
        "model has no admission to refuse them there: they queue); the work policy "
        "sees them as Serve's context gives them, a count, at the mean patches of a call. "
        "`serve-default` is Serve's power of two choices on ongoing requests, each request "
        "queued at the replica it was sent to.",
        "",
        "Requests, each a third of the patch load: "
        + ", ".join(f"{n} ({p:,} patches)" for n, p, _ in KINDS)
        + ". Loads: **step** 0.3 P -> 2.5 P for t in [20, 140) s -> 0.3 P; **sawtooth** "
        "three 60 s ramps 0.2 P -> 3 P, then 0.2 P. Queue delay: arrival to start of work, "
        "of the requests arriving during the load (step: [20, 140) s; sawtooth: [0, 180) s); "
        "'settled': those arriving after the first reaction (step: [50, 140) s, sawtooth: "
        "[60, 180) s). No policy holds the target through the first step: the load jumps "
        "8x and new capacity comes only after the upscale delay plus start-up (10 s).",
        "",
        f"Each row pools {len(SEEDS)} runs (seeds {', '.join(map(str, SEEDS))}: the same "
        "arrivals for every row): peak and p95 over all their requests; replica-seconds the "
        "mean of the runs.",
        "",
        "| load | policy | router | peak queue delay (s) | p95 (s) | settled peak (s) "
        f"| replica-seconds | most replicas | replicas at {DURATION_S:g} s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (load_name, policy, router), r in results.items():
        s = r.pooled
        lines.append(
            f"| {load_name} | {policy} | {router} | {s['peak_delay_s']:.2f} | "
            f"{s['p95_delay_s']:.2f} | {s['settled_peak_delay_s']:.2f} | "
            f"{s['replica_seconds']:.0f} | "
            f"{s['max_replicas']} | {s['final_replicas']} |"
        )
    lines += [
        "",
        "Per seed, vitserve's work policy and work router against the request-count "
        "policy with Serve's router (peak / p95 / settled peak, s):",
        "",
        "| load | seed | work policy, work router | request policy, Serve's router |",
        "|---|---|---|---|",
    ]
    for load_name in LOADS:
        ours, theirs = results[(load_name, *OURS)], results[(load_name, *THEIRS)]
        for seed, a, b in zip(SEEDS, ours.per_seed, theirs.per_seed, strict=True):
            cells = [
                " / ".join(
                    f"{x[k]:.1f}" for k in ("peak_delay_s", "p95_delay_s", "settled_peak_delay_s")
                )
                for x in (a, b)
            ]
            lines.append(f"| {load_name} | {seed} | {cells[0]} | {cells[1]} |")
    worse = [
        f"{load_name} seed {seed} ("
        + ", ".join(
            f"{label} {a[k]:.1f} s vs {b[k]:.1f} s"
            for label, k in (("peak", "peak_delay_s"), ("p95", "p95_delay_s"))
            if a[k] > b[k]
        )
        + ")"
        for load_name in LOADS
        for seed, a, b in zip(
            SEEDS,
            results[(load_name, *OURS)].per_seed,
            results[(load_name, *THEIRS)].per_seed,
            strict=True,
        )
        if a["p95_delay_s"] > b["p95_delay_s"] or a["peak_delay_s"] > b["peak_delay_s"]
    ]
    if worse:
        lines += [
            "",
            "Runs where vitserve's work policy and router did worse than the request-count "
            f"policy with Serve's router on the peak or the p95: {'; '.join(worse)}. One queue "
            "in front of "
            "the pool spreads a transient's wait over every request that arrives in it, where "
            "Serve's router leaves it on the requests queued at the first replica: fewer "
            "requests wait, each longer (the peak).",
        ]
    lines += ["", "![replicas and queue delay over time, seed 0](autoscaling-sim.png)", ""]
    (out_dir / "autoscaling-sim.md").write_text("\n".join(lines))
    _plot(results, out_dir / "autoscaling-sim.png")


#: vitserve's work policy and router, and what a Serve user runs otherwise: (policy, router)
OURS, THEIRS = ("work", "work"), ("requests", "serve-default")


#: The runs plotted: what vitserve runs by default, and the request-count policy as Serve routes.
CURVES = {OURS: "tab:blue", THEIRS: "tab:red"}


def _plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 6), sharex=True)
    for col, load_name in enumerate(LOADS):
        load = LOADS[load_name][0]
        for (policy, router), color in CURVES.items():
            run = results[load_name, policy, router].runs[0]
            label = f"{policy} policy, {router} router"
            axes[0][col].step(run.times, run.replicas, where="post", color=color, label=label)
            axes[1][col].plot(run.times, run.delay, color=color, label=label, lw=0.8)
        ts = results[(load_name, *OURS)].runs[0].times
        axes[0][col].plot(
            ts, [load(t) / P for t in ts], color="gray", ls=":", label="offered load / P"
        )
        axes[0][col].set_title(f"{load_name} load")
        axes[0][col].set_ylabel("replicas")
        axes[1][col].axhline(TARGET_QUEUE_DELAY_S, color="gray", ls="--", lw=0.8)
        axes[1][col].set_ylabel("queue delay of a new request (s)")
        axes[1][col].set_xlabel("t (s)")
        axes[0][col].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    results = run_all()
    out = Path(__file__).resolve().parent / "results"
    write_report(results, out)
    print((out / "autoscaling-sim.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
