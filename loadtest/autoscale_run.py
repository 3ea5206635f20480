"""A real Serve run of the work policy: one vitserve application whose CPU encoder autoscales
(min 1, max 2, upscale delay 1 s, downscale delay 8 s) under a ~20 s load step of new images,
then idle; the encoder's replica count sampled every 0.5 s. Writes
``loadtest/results/autoscaling-real.md`` and ``.png``::

    RAY_AUTH_MODE=disabled flock /tmp/vitserve-heavy.lock python loadtest/autoscale_run.py
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from pathlib import Path

import httpx

LOAD_S, IDLE_S, CONCURRENCY, IMAGE_PX = 20.0, 30.0, 8, 448


def main() -> int:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import free_port, serve_app, start_serve
    from vitserve.testing.images import make_image
    from vitserve.testing.models import cached_model

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    url = start_serve("127.0.0.1", free_port())
    cfg = VitserveConfig.load(
        {
            "model": str(cached_model("qwen2_vl", "small")),
            "dtype": "fp32",
            "torch_threads": 1,
            "namespace": f"autoscale-{time.time_ns()}",
            "encoder.num_cpus": 0.5,
            "ingress.num_cpus": 0.1,
            "encoder.autoscaling": {
                "policy": "work",
                "min_replicas": 1,
                "max_replicas": 2,
                "target_queue_delay_s": 0.5,
                "upscale_delay_s": 1.0,
                "downscale_delay_s": 8.0,
            },
        }
    )
    serve_app(build_application(cfg), name="autoscale", route_prefix="/autoscale")
    t0 = time.monotonic()
    timeline: list[tuple[float, int, int]] = []  # (t, running replicas, requests done)
    done = [0]
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            st = serve.status().applications["autoscale"].deployments["EncoderDeployment"]
            running = st.replica_states.get("RUNNING", 0)
            timeline.append((time.monotonic() - t0, running, done[0]))
            time.sleep(0.5)

    def client(worker: int) -> None:
        with httpx.Client(timeout=120) as c:
            k = 0
            while time.monotonic() - t0 < LOAD_S:
                img = make_image(IMAGE_PX, IMAGE_PX, fmt="PNG", seed=worker * 100_000 + k)
                r = c.post(
                    f"{url}/autoscale/v1/encode", files=[("images", ("0.png", img, "image/png"))]
                )
                r.raise_for_status()
                done[0] += 1
                k += 1

    threads = [threading.Thread(target=sampler)]
    threads += [threading.Thread(target=client, args=(w,)) for w in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    end_load = time.monotonic() - t0
    while time.monotonic() - t0 < end_load + IDLE_S:
        time.sleep(0.5)
    stop.set()
    threads[0].join()
    serve.delete("autoscale")
    serve.shutdown()
    ray.shutdown()
    write(timeline, end_load)
    return 0


def write(timeline: list[tuple[float, int, int]], end_load: float) -> None:
    out = Path(__file__).resolve().parent / "results"
    changes = [timeline[0]] + [s for p, s in itertools.pairwise(timeline) if s[1] != p[1]]
    lines = [
        "# Autoscaling on work: a real Serve run (CPU)",
        "",
        "`loadtest/autoscale_run.py`: Ray 2.60 with 2 CPUs, one vitserve application "
        "(Qwen2-VL `small` test model, fp32, 1 torch thread), encoder num_cpus 0.5, "
        "`encoder.autoscaling`: policy work, min 1, max 2, target_queue_delay_s 0.5, "
        "upscale_delay_s 1, downscale_delay_s 8. Load: "
        f"{CONCURRENCY} concurrent clients posting new {IMAGE_PX}px images for "
        f"{LOAD_S:g} s (the last answered at {end_load:.1f} s), then idle. Running encoder "
        "replicas from `serve.status()` every 0.5 s.",
        "",
        "| t (s) | running encoder replicas | requests answered |",
        "|---|---|---|",
    ]
    lines += [f"| {t:.1f} | {n} | {d} |" for t, n, d in changes]
    lines += [
        "",
        f"Last sample: t={timeline[-1][0]:.1f} s, {timeline[-1][1]} replica(s).",
        "",
        "![replicas over time](autoscaling-real.png)",
        "",
    ]
    (out / "autoscaling-real.md").write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.step([s[0] for s in timeline], [s[1] for s in timeline], where="post")
    ax.axvspan(0, end_load, color="orange", alpha=0.2, label="load")
    ax.set_xlabel("t (s)")
    ax.set_ylabel("running encoder replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "autoscaling-real.png", dpi=90)
    print((out / "autoscaling-real.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
