"""Service benchmark: the vitserve application on the embedded default, measured in one run.

(a) Overhead: the same kind of image (448x448, the demo model: Qwen2-VL with a ViT-B tower)
    encoded in-process by an ``EncoderEngine`` in this process vs through HTTP (ingress ->
    encoder -> node store, preprocessing in the encoder), one at a time, alternating, each
    image new to the service. Figure: per-round paired ratio HTTP / in-process, and its median.
(b) Throughput: ``--clients`` concurrent clients each sending one-image requests of mixed
    resolutions (every image new), against two applications served side by side: bucketed
    batching on, and ``batching.enabled=false`` (one image per forward). Images/s and forwards.
(c) An all-cached request: ``--cached-images`` images the store holds, sent again (bytes, and
    key-only JSON); median latency.

    python loadtest/bench_service.py                        # all three, defaults
    python loadtest/bench_service.py --rounds 10 --clients 1 4 16 --images 24
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import os
import statistics
import time
from typing import Any

import httpx

from vitserve.testing.images import make_image

MIXED = [(448, 448), (320, 240), (640, 480), (224, 224), (480, 320), (336, 336)]
_seeds = itertools.count(1_000_000)


def new_image(width: int, height: int) -> bytes:
    return make_image(width, height, fmt="JPEG", seed=next(_seeds))


def post(client: httpx.Client, url: str, images: list[bytes]) -> dict[str, Any]:
    files = [("images", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(images)]
    response = client.post(f"{url}/v1/encode", files=files)
    response.raise_for_status()
    body = response.json()
    errors = [i["error"] for i in body["items"] if "error" in i]
    if errors:
        raise RuntimeError(f"encode failed: {errors}")
    return body


def start(apps: dict[str, dict[str, Any]], model: str) -> tuple[str, dict[str, Any]]:
    """Local Ray and Serve with one application per entry (route prefix = name)."""
    from ray import serve

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.common.serving import build_application
    from vitserve.deployments.runner.local import free_port, serve_app, start_ray, start_serve

    start_ray(num_cpus=8)  # logical CPUs: both applications' replicas must fit
    url = start_serve("127.0.0.1", free_port())
    handles = {}
    for name, overrides in apps.items():
        cfg = VitserveConfig.load(
            {"model": model, "namespace": f"bench-{name}-{time.time()}", **overrides}
        )
        serve_app(build_application(cfg), name=name, route_prefix=f"/{name}")
        handles[name] = serve.get_deployment_handle("EncoderDeployment", app_name=name)
    return url, handles


def overhead(url: str, handle: Any, engine: Any, rounds: int) -> None:
    client = httpx.Client(timeout=600)
    engine.encode([new_image(448, 448)])  # warm-up both paths
    post(client, f"{url}/on", [new_image(448, 448)])
    device0 = handle.counters.remote().result()["seconds"]
    local, remote, ratios = [], [], []
    for _ in range(rounds):
        image = new_image(448, 448)
        t = time.perf_counter()
        [out] = engine.encode([image])
        local.append(time.perf_counter() - t)
        assert out.num_tokens == 256
        t = time.perf_counter()
        post(client, f"{url}/on", [new_image(448, 448)])
        remote.append(time.perf_counter() - t)
        ratios.append(remote[-1] / local[-1])
    print(f"\n(a) overhead, one 448x448 image at a time, {rounds} rounds")
    print(f"    in-process median {statistics.median(local) * 1e3:8.1f} ms")
    print(f"    HTTP       median {statistics.median(remote) * 1e3:8.1f} ms")
    print(
        f"    ratio of medians {statistics.median(remote) / statistics.median(local):.3f}x; "
        f"median paired ratio {statistics.median(ratios):.3f}x "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    device = handle.counters.remote().result()["seconds"]
    forward = (device["forward_and_encode"] - device0["forward_and_encode"]) / rounds
    publish = (device["publish"] - device0["publish"]) / rounds
    print(
        f"    of which in the encoder replica: forward+record {forward * 1e3:.1f} ms, "
        f"publish {publish * 1e3:.1f} ms (mean per image)"
    )


def throughput(
    url: str, handles: dict[str, Any], clients: list[int], images: int, repeats: int
) -> None:
    print(f"\n(b) throughput, {images} one-image requests of mixed sizes {MIXED}, every image new")
    print("    clients  app  images/s  forwards  (per repeat)")
    for c in clients:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(repeats):
            for name in ("on", "off"):  # side by side, alternating
                batch = [new_image(*MIXED[i % len(MIXED)]) for i in range(images)]
                client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=c))
                before = handles[name].counters.remote().result()["forward_calls"]
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(c) as pool:
                    n, app_url = len(batch), f"{url}/{name}"
                    list(pool.map(post, [client] * n, [app_url] * n, [[b] for b in batch]))
                elapsed = time.perf_counter() - t
                forwards = handles[name].counters.remote().result()["forward_calls"] - before
                rates[name].append(images / elapsed)
                print(f"    {c:>7}  {name:<3}  {images / elapsed:8.3f}  {forwards:>8}")
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        paired = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
        print(
            f"    {c:>7} clients: batching on/off = {on / off:.3f}x "
            f"(paired {', '.join(f'{p:.2f}' for p in paired)})"
        )


def cached(url: str, n: int, repeat: int) -> None:
    import base64

    client = httpx.Client(timeout=600)
    images = [new_image(*MIXED[i % len(MIXED)]) for i in range(n)]
    keys = [i["key"] for i in post(client, f"{url}/on", images)["items"]]
    doc = {"images": [{"key": k} for k in keys]}
    data_doc = {"images": [{"data": base64.b64encode(b).decode()} for b in images]}
    timings: dict[str, list[float]] = {"multipart bytes": [], "JSON keys": [], "JSON base64": []}
    for _ in range(repeat):
        t = time.perf_counter()
        body = post(client, f"{url}/on", images)
        timings["multipart bytes"].append(time.perf_counter() - t)
        assert all(i["cached"] for i in body["items"])
        t = time.perf_counter()
        body = client.post(f"{url}/on/v1/encode", json=doc).json()
        timings["JSON keys"].append(time.perf_counter() - t)
        assert all(i["cached"] for i in body["items"])
        t = time.perf_counter()
        body = client.post(f"{url}/on/v1/encode", json=data_doc).json()
        timings["JSON base64"].append(time.perf_counter() - t)
        assert all(i["cached"] for i in body["items"])
    size = sum(map(len, images))
    print(f"\n(c) all-cached request of {n} images ({size / 1e6:.2f} MB), median of {repeat}")
    for name, samples in timings.items():
        print(f"    {name:<16} {statistics.median(samples) * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="(a) paired rounds")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--images", type=int, default=24, help="(b) images per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="(b) repeats per point")
    parser.add_argument("--cached-images", type=int, default=8)
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c"])
    args = parser.parse_args()

    import torch

    from vitserve.deployments.common.serving import resolve_model
    from vitserve.encoder.engine import EncoderEngine

    model = resolve_model("demo")
    engine = EncoderEngine.from_pretrained(model)
    print(
        f"model: demo (Qwen2-VL, ViT-B tower), {engine.dtype} on {engine.device}; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    url, handles = start({"on": {}, "off": {"batching": {"enabled": False}}}, model)
    if "a" not in args.skip:
        overhead(url, handles["on"], engine, args.rounds)
    if "b" not in args.skip:
        throughput(url, handles, args.clients, args.images, args.repeats)
    if "c" not in args.skip:
        cached(url, args.cached_images, 20)


if __name__ == "__main__":
    main()
