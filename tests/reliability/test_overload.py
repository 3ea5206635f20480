"""Memory pressure: a 10x overload of new images against a real application, and a very large
multi-image request against the activation budget.

The overload runs the demo's ViT-B-sized Qwen2-VL (``small``, fp32) in the session's Ray
cluster behind an encoder that admits ``ADMITTED`` requests (Serve's ``max_ongoing_requests`` +
``max_queued_requests``), with ten times as many clients, each sending a new image per request
and waiting ``Retry-After`` after a 429. Its store is a tiered store whose two tiers have small
byte budgets: a private node-store actor (LRU) in front of a private redis-server with
``maxmemory`` and ``allkeys-lru``, so that both evict during the run. Sampled while it runs: the
encoder replica's RSS (psutil), the node actor's bytes and Redis's ``used_memory``.

The 64-image 2K request on the ``small`` model takes minutes on a 2-core CPU (measured on a
2-vCPU AMX Xeon: 0.65 s per image in bf16, 1.9 s in fp32, engine only), so it runs only when
``VITSERVE_TEST_LARGE=1`` (see the README's reliability section).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import App, RedisServer
from vitserve.testing.images import make_image

ADMITTED = 4  # encoder: 2 running + 2 queued requests; Serve answers the rest BackPressureError
CLIENTS = 10 * ADMITTED
LOAD_S = 8.0  # at least; and until MIN_ADMITTED new images were encoded (at most MAX_LOAD_S)
# Enough records to overflow both tiers' budgets (a 64-row record is ~64 KiB): the evictions
# come from the work done, whatever the CPU's speed.
MIN_ADMITTED = 24
MAX_LOAD_S = 180.0
IMAGE = (224, 224)  # 256 patches of the small model: a fraction of a second per forward
# The small model's tower (ViT-B: 768 wide, 12 heads, MLP 3072) at fewer layers than 12: a
# forward's activations are one layer's (the layers run one after another, and the planner's
# estimate has no depth in it), so the memory a test bounds is the 12-layer tower's, at a
# fraction of its forwards' CPU. The 64-image row asserts memory only and takes 2. The overload
# keeps all 12 (None): the refused traffic's CPU is a fixed cost, so the shorter the forward, the
# nearer the admitted latency's ratio to one request alone comes to P90_FACTOR (on a 2-vCPU
# EPYC, p90 7.7x alone with 12 layers; with 4, 8.5x alone and 12.4x in the system tier; with 2,
# 11x alone).
OVERLOAD_DEPTH = None
LARGE_DEPTH = 2
BUDGET_BYTES = 64 * 2**20  # the encoder's activation budget
RSS_SLACK = 256 * 2**20  # weights' pages touched later, allocator slack, queued inputs/outputs
NODE_BYTES = 512 * 2**10  # the node tier's budget: about 8 of those records
REDIS_MAXMEMORY = 2 * 2**20  # Redis's own use is ~1 MiB of it
# Admitted latency against the unloaded median. Admission keeps ADMITTED requests on the
# encoder, so one waits for at most ADMITTED forwards; on 2 vCPUs the refused traffic also
# takes CPU from them, and the p99 of ~28 admitted requests (nearly the slowest) went past 15x
# in CI. An unbounded queue grows with the load instead: ~40x and more at its end.
P90_FACTOR = 15.0
MAX_FACTOR = 35.0  # one request stuck (a 60 s claim wait, a lost call) still fails
L1_ACTOR = "vitserve-test-overload-l1"


def small_model(depth: int | None) -> Path:
    """The demo model (Qwen2-VL) with its ViT-B tower at ``depth`` layers (None: its 12), built
    once into the user's cache."""
    from vitserve.deployments.common.serving import DEMO_FAMILY, DEMO_PRESET
    from vitserve.testing.models import cached_model

    return cached_model(DEMO_FAMILY, DEMO_PRESET, depth=depth)


@pytest.fixture(scope="module")
def lru_redis() -> Any:
    server = RedisServer("--maxmemory", str(REDIS_MAXMEMORY), "--maxmemory-policy", "allkeys-lru")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def overload_app(deploy, lru_redis: RedisServer) -> Any:
    from vitserve.cache.urls import tiered_url

    l1 = f"node://?actor_name={L1_ACTOR}&max_bytes={NODE_BYTES}&read_cache_bytes=0"
    app = deploy(
        "overload",
        model=str(small_model(OVERLOAD_DEPTH)),
        store=tiered_url(l1, lru_redis.url),
        budget_bytes=BUDGET_BYTES,
        batching={"max_batch_patches": 4096},
        encoder={"max_ongoing_requests": 2, "max_queued_requests": 2},
    )
    yield app
    deploy.remove("overload")


def _encoder_process(app: App) -> Any:
    """The encoder replica's process (Ray titles it ``ray::ServeReplica:<app>:<deployment>``)."""
    import psutil

    tag = f"ServeReplica:{app.name}:EncoderDeployment"
    found = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(tag in part for part in p.info["cmdline"] or [])
    ]
    assert len(found) == 1, [p.info["cmdline"] for p in found]
    return found[0]


class Sampler:
    """Samples the encoder's RSS, the node tier's bytes and Redis's used_memory until stopped;
    keeps the peaks."""

    def __init__(self, process: Any, node: Any, redis_url: str) -> None:
        import redis

        self.process, self.node = process, node
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.rss = self.node_bytes = self.used_memory = 0
        self.node_evictions = self.redis_evictions = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rss = max(self.rss, self.process.memory_info().rss)
            stats = self.node.stats()
            self.node_bytes = max(self.node_bytes, stats["bytes"])
            self.node_evictions = stats["evictions"]
            info = self.redis.info("memory") | self.redis.info("stats")
            self.used_memory = max(self.used_memory, info["used_memory"])
            self.redis_evictions = info["evicted_keys"]
            self.samples += 1
            self._stop.wait(0.1)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.redis.close()


def test_a_10x_overload_is_refused_with_429_and_every_budget_holds(
    overload_app: App, lru_redis: RedisServer, reliability
) -> None:
    from vitserve.cache.node import NodeStore

    app = overload_app
    seeds = iter(range(9_000_000, 9_100_000))
    lock = threading.Lock()

    def image() -> bytes:
        with lock:
            return make_image(*IMAGE, seed=next(seeds))

    # Unloaded: the latency of one new image at a time (warm), and the replica's idle RSS.
    client = httpx.Client(timeout=60)
    baseline = []
    for _ in range(4):
        started = time.monotonic()
        response = client.post(
            f"{app.url}/v1/encode", files=[("images", ("i.png", image(), "image/png"))]
        )
        assert response.status_code == 200, response.text
        baseline.append(time.monotonic() - started)
    unloaded = float(np.median(baseline[1:]))
    process = _encoder_process(app)
    idle_rss = process.memory_info().rss

    results: list[tuple[int, float]] = []  # (status, seconds)
    bad: list[str] = []
    stop = threading.Event()

    def run() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = c.post(
                        f"{app.url}/v1/encode", files=[("images", ("i.png", image(), "image/png"))]
                    )
                except httpx.HTTPError as exc:  # a dropped connection is a failure too
                    with lock:
                        bad.append(type(exc).__name__)
                    continue
                with lock:
                    results.append((r.status_code, time.monotonic() - started))
                if r.status_code == 429:
                    if r.json()["error"]["type"] != "BackpressureError" or not r.headers.get(
                        "retry-after"
                    ):
                        with lock:
                            bad.append(f"429 without BackpressureError/Retry-After: {r.text}")
                    stop.wait(min(1.0, float(r.headers.get("retry-after", 1))))
                elif r.status_code != 200:
                    with lock:
                        bad.append(f"{r.status_code}: {r.text[:200]}")

    def admitted() -> int:
        with lock:
            return sum(1 for s, _ in results if s == 200)

    node = NodeStore(actor_name=L1_ACTOR, max_bytes=NODE_BYTES, read_cache_bytes=0)
    with Sampler(process, node, lru_redis.url) as sampler:
        workers = [threading.Thread(target=run, daemon=True) for _ in range(CLIENTS)]
        for w in workers:
            w.start()
        began = time.monotonic()
        while (time.monotonic() - began < LOAD_S or admitted() < MIN_ADMITTED) and (
            time.monotonic() - began < MAX_LOAD_S
        ):
            time.sleep(0.2)
        load_s = time.monotonic() - began
        stop.set()
        for w in workers:
            w.join(timeout=120)
    assert not any(w.is_alive() for w in workers)

    statuses = [s for s, _ in results]
    ok = sorted(t for s, t in results if s == 200)
    refused, errors = statuses.count(429), sum(s >= 500 for s in statuses)
    assert not bad, bad[:5]
    assert errors == 0 and set(statuses) <= {200, 429}, sorted(set(statuses))
    assert refused > 0 and len(ok) >= MIN_ADMITTED, (len(ok), refused, load_s)
    # The admitted requests' latency stays within a generous factor of one request alone.
    p90, slowest = float(np.percentile(ok, 90)), ok[-1]
    assert p90 <= P90_FACTOR * unloaded, (p90, slowest, unloaded)
    assert slowest <= MAX_FACTOR * unloaded, (p90, slowest, unloaded)
    # The budgets held: the encoder's RSS, the node tier's bytes, Redis's used_memory.
    assert sampler.samples >= 10
    assert sampler.rss <= idle_rss + BUDGET_BYTES + RSS_SLACK, (sampler.rss, idle_rss)
    assert sampler.node_bytes <= NODE_BYTES and sampler.node_evictions > 0
    assert sampler.used_memory <= REDIS_MAXMEMORY and sampler.redis_evictions > 0
    node.close()

    mib = 2**20
    reliability.record(
        "10x overload of new images (memory pressure)",
        tried=len(statuses) + len(bad),
        failed=errors + len(bad),
        wrong=0,
        lost=0,
        note=f"{CLIENTS} clients for {load_s:.0f} s against {ADMITTED} admitted: {len(ok)} x 200, "
        f"{refused} x 429, {errors} x 5xx; admitted p90 {p90:.2f} s, slowest {slowest:.2f} s "
        f"vs {unloaded:.2f} s alone; "
        f"encoder RSS +{(sampler.rss - idle_rss) / mib:.0f} MiB (budget "
        f"{BUDGET_BYTES // mib} MiB); node tier <= {sampler.node_bytes // 1024} KiB of "
        f"{NODE_BYTES // 1024}; Redis used_memory <= {sampler.used_memory / mib:.1f} of "
        f"{REDIS_MAXMEMORY / mib:g} MiB",
    )


# -- a very large request -------------------------------------------------------------------------
LARGE_IMAGES, LARGE_SIDE = 64, 2048
LARGE_BUDGET = 512 * 2**20

# Memory is measured from the resident set once the inputs are prepared and the memory the
# decoding freed is given back to the system (glibc's malloc_trim: freed pages left resident would
# take the activations unseen), to the high-water mark that follows (Linux's VmHWM, reset through
# /proc/self/clear_refs, so the decoding's own peak does not hide the forwards'). First each of
# the plan's first two forwards alone, trimmed before each: what one forward's activations take.
# Then the whole run as a replica runs it: the engine tunes glibc to keep freed buffers for
# reuse (``tune_cpu_allocator``), so between forwards the heap keeps what fragmentation strands.
_LARGE_SCRIPT = """
import ctypes, gc, json, sys, time
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
def settled():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss
from vitserve.encoder.engine import EncoderEngine
from vitserve.testing.images import make_image
model, dtype, n, side, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
    int(sys.argv[5])
engine = EncoderEngine.from_pretrained(model, device="cpu", dtype=dtype, budget_bytes=budget)
images = [make_image(side, side, seed=10_000 + i) for i in range(n)]
prepared = [engine.prepare_one(b, i) for i, b in enumerate(images)]
del images
plan = engine.plan(prepared)
forward_peaks = []
for batch in plan.batches[:2]:
    members = [prepared[i] for i in batch.indices]
    before = settled()
    engine.run(members, engine.plan(members))
    forward_peaks.append(status("VmHWM:") - before)
before = settled()
started = time.perf_counter()
out = engine.run(prepared, plan)
seconds = time.perf_counter() - started
peak = status("VmHWM:")
print(json.dumps({"seconds": seconds, "forwards": len(plan.batches), "before": before,
                  "peak": peak, "forward_peaks": forward_peaks, "embeddings": len(out),
                  "act_bytes": max(b.act_bytes for b in plan.batches),
                  "output_bytes": sum(e.tensor.nbytes for e in out)}))
"""
#: what the tuned allocator may keep beyond one forward's activations over a whole run: freed
#: buffers stranded between forwards (this run measured +362 to +881 MiB over the inputs in
#: eleven runs on a 2-vCPU AMX Xeon, budget 512 MiB, outputs 30 MiB; +272 and +382 MiB on a
#: 2-vCPU EPYC, one image per forward)
RETAINED_BYTES = LARGE_BUDGET
LARGE_TIMEOUT_S = 2400  # within .ci/run's foreground steps, which outlast it


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("VITSERVE_TEST_LARGE") != "1",
    reason="minutes on a CPU: set VITSERVE_TEST_LARGE=1",
)
def test_64_images_at_2k_encode_within_the_activation_budget(reliability) -> None:
    """Engine level, in a fresh process with an encoder replica's allocator settings
    (``WORKER_ENV``, and the engine's own tuning): every image is encoded in several forwards;
    one forward (measured alone) stays within the budget and some slack (a 2-image forward
    measured +215 to +500 MiB on the AMX Xeon, its estimate 434); the whole run's peak stays
    within the budget, the outputs and what the tuned allocator keeps (``RETAINED_BYTES``) --
    far from the ~14 GiB estimated for the 64 images in one forward."""
    import json

    from vitserve.deployments.common.serving import WORKER_ENV

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _LARGE_SCRIPT,
            str(small_model(LARGE_DEPTH)),
            "fp32",
            str(LARGE_IMAGES),
            str(LARGE_SIDE),
            str(LARGE_BUDGET),
        ],
        env={**os.environ, **WORKER_ENV},
        capture_output=True,
        text=True,
        # a guard against a hang, not a bound on time: .ci/run runs this at nice 19 beside its
        # other steps, on the CPU they leave idle (with the 12-layer tower it took 655 s alone on
        # a 2-vCPU EPYC and passed 900 s beside the vLLM step; see LARGE_DEPTH)
        timeout=LARGE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["embeddings"] == LARGE_IMAGES
    assert got["act_bytes"] <= LARGE_BUDGET and got["forwards"] > 1
    forward = max(got["forward_peaks"])
    assert forward <= LARGE_BUDGET + RSS_SLACK, got
    grown = got["peak"] - got["before"]
    assert grown <= LARGE_BUDGET + got["output_bytes"] + RETAINED_BYTES, got
    mib = 2**20
    reliability.record(
        f"{LARGE_IMAGES} images at {LARGE_SIDE}px in one call (small model's tower at "
        f"{LARGE_DEPTH} layers, fp32)",
        tried=LARGE_IMAGES,
        failed=LARGE_IMAGES - got["embeddings"],
        wrong=0,
        lost=0,
        note=f"{got['forwards']} forwards in {got['seconds']:.0f} s; one forward alone peaks at "
        f"+{forward / mib:.0f} MiB (budget {LARGE_BUDGET // mib} MiB, estimate "
        f"{got['act_bytes'] / mib:.0f}); the whole run at +{grown / mib:.0f} MiB over the "
        f"prepared inputs (outputs {got['output_bytes'] / mib:.0f} MiB, freed buffers kept)",
    )
