"""The client SDK in the multi-turn agent scenario, against one in-process vitserve app.

One run, one application (local Ray, Serve's HTTP proxy, the Redis store at ``--redis``, the
random-weight Qwen2-VL ``small`` model: a ViT-B tower, built once into the cache; for part 4,
the prefill application beside it), four parts:

1. **Multi-turn probe.** Turns 1..``--turns``; each turn sends the whole conversation's images
   again plus one new one, under three strategies, each with its own fresh images (distinct
   seeds), interleaved turn by turn (their order rotates each turn):

   * *per-image keys (vitserve)*: ``client.encode(all images so far)`` with a direct-store
     client: keys computed locally, one store probe, only the new image uploaded and encoded;
   * *one key for the whole image set* (a prefix / request-level cache keyed on the set): the
     set's key is blake3 of the concatenation of its images' bytes, and each image is sent
     with that key in a PNG ``tEXt`` chunk, so its content key belongs to this set only: the
     set's first sight (every turn, since the set grows) uploads and encodes every image, and
     its entries are stored under the set (reused only by the same set again);
   * *no cache*: before each turn's ``encode`` the conversation's keys are deleted from the
     store (not timed), so every image of every turn is uploaded and encoded.

   Per turn: bytes uploaded (the SDK's ``vitserve_client_bytes_uploaded_total``), images
   encoded and the encoder's forward time (deltas of the encoder deployment's ``counters()``:
   ``images`` and ``seconds["forward_and_encode"]``), the end-to-end ``encode`` time, and the
   fetch time of the whole prompt's image rows (images back to back with ``--text-tokens``
   text tokens before each and at the end, ``fetch_chunk`` per ``--chunk``-token chunk,
   summed).
2. **All-cached encode of 8 images**: direct store probe (``store=`` a Redis URL) vs probe
   through ``POST /v1/probe`` (no store), ``--reps`` calls each, interleaved in blocks of
   ``--block``; p50 and p90.
3. **fetch_chunk bandwidth vs raw redis-py**: ``--fetch-images`` images of
   ``--fetch-size``px, one chunk covering all of them (headers cached after a warm-up: one
   round trip) vs a redis-py pipeline of ``GETRANGE`` over exactly the byte spans the store
   reads (``codec.row_spans`` of each record's header), timed in alternating pairs, ``--reps``
   pairs; medians.
4. **TTFT per turn through the prefill route** (``POST /bench-chat/v1/chat/completions``, the
   prefill application of ``deployments/prefill.py`` deployed after part 3 beside the encoder
   application: same model, same Redis store, rows read from it directly, ``--chunk`` tokens
   per prefill chunk, as part 1's fetch). Turns 1..``--chat-turns`` (default ``--turns``) of an
   agent conversation: turn t sends the user messages 1..t (each a short text and one
   ``--size`` PNG as a ``data:`` URL) with a fixed short assistant reply between them (the same
   text in every turn and strategy, so both strategies' prompts have the same length),
   ``stream: true``, ``temperature: 0``, ``max_tokens: --max-tokens``. Two strategies, each
   with its own images, interleaved turn by turn (the order alternating):

   * *per-image keys (vitserve)*: nothing special: the prefill replica's SDK hashes the images
     first and uploads only the one its store lacks (the new one);
   * *no cache*: before each turn (not timed) the conversation's keys are deleted from the
     store, so every image is uploaded and encoded again.

   TTFT: from sending the request (body serialized beforehand) to the first SSE event after the
   role chunk, the first token's event (its text delta, empty when the token decodes to none;
   if the model stops at once, the finish event), read with httpx streaming. The service
   answers nothing before the prefill is done (the role chunk follows it), and the first token
   is picked from the prefill's last logits, so TTFT covers the encode (hash, probe, uploads,
   encoder forwards), the per-chunk row reads and the chunked prefill. Per turn also: the
   answer's ``usage`` (images uploaded / encoded, rows pulled, prompt tokens, chunks) and the
   encoder deployment's ``counters()`` deltas (images, forward seconds).

    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client.py \\
        --out loadtest/results/client-cpu.md
    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client.py --turns 4 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_hot_path import machine  # noqa: E402
from bench_stores import paired  # noqa: E402

APP = "bench-client"
FAMILY, PRESET = "qwen2_vl", "small"
STRATEGIES = ("per-image keys (vitserve)", "one key for the whole image set", "no cache")
SEED_BASE = {s: 10_000_000 * (i + 1) for i, s in enumerate(STRATEGIES)}
CACHED_SEED, FETCH_SEED, WARM_SEED = 90_000_000, 91_000_000, 92_000_000
SET_TAG = b"vitserve-bench-image-set"
CHAT_APP = "bench-chat"  # the prefill application, at route /bench-chat
CHAT_STRATEGIES = (STRATEGIES[0], STRATEGIES[2])  # per-image keys, no cache
CHAT_SEED_BASE = {CHAT_STRATEGIES[0]: 40_000_000, CHAT_STRATEGIES[1]: 60_000_000}
CHAT_WARM_SEED = 93_000_000
USER_TEXT = "Step {k}: what now?"  # user message k: this text, then its image
ASSISTANT_TEXT = "Click next."  # the assistant's reply between turns (fixed: same prompts)


# -- images ---------------------------------------------------------------------------------------
def png(size: int, seed: int) -> bytes:
    from vitserve.encoder.testimages import make_image

    return make_image(size, size, fmt="PNG", seed=seed)


def tagged(data: bytes, set_key: str) -> bytes:
    """The PNG with a ``tEXt`` chunk naming its image set, just before ``IEND`` (the pixels,
    and so the embedding, are unchanged; the bytes, and so the content key, are the set's)."""
    from vitserve.encoder.testimages import _png_chunk

    iend = _png_chunk(b"IEND", b"")
    assert data.endswith(iend), "not a PNG ending in IEND"
    text = _png_chunk(b"tEXt", SET_TAG + b"\0" + set_key.encode())
    return data[: -len(iend)] + text + iend


def set_key(images: list[bytes]) -> str:
    import blake3

    return blake3.blake3(b"".join(images)).hexdigest()


# -- the service ----------------------------------------------------------------------------------
def start_app(args: argparse.Namespace, model: str) -> tuple[str, Any]:
    """Local Ray, Serve's proxy on a free port, and the application over the Redis store; the
    base URL and the encoder deployment's handle."""
    from ray import serve

    from vitserve.deployments.app import build_application
    from vitserve.deployments.config import VitserveConfig
    from vitserve.deployments.local import free_port, serve_app, start_ray, start_serve

    start_ray(num_cpus=2)
    url = start_serve("127.0.0.1", free_port())
    fields: dict[str, Any] = {"model": model, "store": args.redis,
                              "namespace": f"bench-client-{os.getpid()}"}  # fmt: skip
    if args.dtype:
        fields["dtype"] = args.dtype
    serve_app(build_application(VitserveConfig.load(fields)), name=APP, route_prefix="/")
    return url, serve.get_deployment_handle("EncoderDeployment", app_name=APP)


class Encoder:
    """Deltas of the encoder deployment's counters: images encoded, forward seconds."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.last = self.read()

    def read(self) -> tuple[int, float]:
        c = self.handle.counters.remote().result()
        return int(c["images"]), float(c["seconds"].get("forward_and_encode", 0.0))

    def delta(self) -> tuple[int, float]:
        now = self.read()
        out = (now[0] - self.last[0], now[1] - self.last[1])
        self.last = now
        return out


def new_client(url: str, store: str | None) -> tuple[Any, Any]:
    """An EncoderClient (direct store when ``store``) with its own metrics registry."""
    from prometheus_client import CollectorRegistry

    from vitserve.client import EncoderClient

    registry = CollectorRegistry()
    client = EncoderClient(url, store=store, registry=registry, timeout_s=600)
    client.describe()
    return client, registry


def uploaded(registry: Any) -> float:
    return registry.get_sample_value("vitserve_client_bytes_uploaded_total") or 0.0


def layout(handles: list[Any], text_tokens: int) -> tuple[list[int], int]:
    """Prompt offsets of the images laid out back to back, ``text_tokens`` before each and at
    the end; the prompt's length."""
    offsets, pos = [], 0
    for h in handles:
        pos += text_tokens
        offsets.append(pos)
        pos += h.num_tokens
    return offsets, pos + text_tokens


def fetch_prompt(client: Any, handles: list[Any], text_tokens: int, chunk: int) -> float:
    """Seconds to fetch the prompt's image rows, chunk by chunk (sequential, no prefetch)."""
    from vitserve.client import chunk_bounds

    offsets, length = layout(handles, text_tokens)
    start = time.perf_counter()
    rows = 0
    for s, e in chunk_bounds(length, chunk):
        rows += client.fetch_chunk(handles, offsets, s, e).rows
    elapsed = time.perf_counter() - start
    assert rows == sum(h.num_tokens for h in handles), (rows, handles)
    return elapsed


# -- 1. multi-turn --------------------------------------------------------------------------------
def multi_turn(url: str, encoder: Encoder, args: argparse.Namespace) -> dict[str, list[dict]]:
    clients = {s: new_client(url, args.redis) for s in STRATEGIES}
    images = {s: [png(args.size, SEED_BASE[s] + t) for t in range(args.turns)]
              for s in STRATEGIES}  # fmt: skip
    rows: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
    print(f"\n== 1. multi-turn probe: {args.turns} turns, {args.size}x{args.size} PNGs "
          f"(~{statistics.mean(map(len, images[STRATEGIES[0]])) / 1e3:.0f} KB each)")  # fmt: skip
    print(f"{'strategy':<34} {'turn':>4} {'imgs':>4} {'uploaded KB':>11} {'encoded':>7} "
          f"{'encoder ms':>10} {'encode ms':>9} {'fetch ms':>8}", flush=True)  # fmt: skip
    for turn in range(1, args.turns + 1):
        order = STRATEGIES[turn % 3 :] + STRATEGIES[: turn % 3]  # rotate who goes first
        for strategy in order:
            client, registry = clients[strategy]
            convo = images[strategy][:turn]
            send = convo
            if strategy == STRATEGIES[1]:
                key = set_key(convo)
                send = [tagged(b, key) for b in convo]
            elif strategy == STRATEGIES[2]:
                client.core.store.delete(client.core.keys_of(convo))
            before = uploaded(registry)
            encoder.delta()
            start = time.perf_counter()
            handles = client.encode(send)
            e2e = time.perf_counter() - start
            n_encoded, forward_s = encoder.delta()
            fetch_s = fetch_prompt(client, handles, args.text_tokens, args.chunk)
            row = {"turn": turn, "images": len(convo), "uploaded": uploaded(registry) - before,
                   "encoded": n_encoded, "encoder_ms": forward_s * 1e3, "encode_ms": e2e * 1e3,
                   "fetch_ms": fetch_s * 1e3}  # fmt: skip
            rows[strategy].append(row)
            print(f"{strategy:<34} {turn:>4} {row['images']:>4} {row['uploaded'] / 1e3:>11.1f} "
                  f"{n_encoded:>7} {row['encoder_ms']:>10.1f} {row['encode_ms']:>9.1f} "
                  f"{row['fetch_ms']:>8.2f}", flush=True)  # fmt: skip
    for client, _ in clients.values():
        client.close()
    return rows


def turn_ratios(rows: list[dict], key: str) -> tuple[float, float]:
    """Last turn / first turn of ``key``, and the mean of the last (up to) 4 turns over the
    mean of the first (up to) 4 (a steadier reading on a noisy machine)."""
    k = min(4, len(rows))
    first, last = rows[0][key], rows[-1][key]
    head = statistics.mean(r[key] for r in rows[:k])
    tail = statistics.mean(r[key] for r in rows[-k:])
    return last / first if first else float("nan"), tail / head if head else float("nan")


# -- 2. all-cached encode -------------------------------------------------------------------------
def blocked(fns: dict[str, Callable[[], Any]], reps: int, block: int) -> dict[str, list[float]]:
    """``reps`` timed calls of each function, in alternating blocks of ``block`` calls (A-B-A-B
    ..., the first of each block untimed), so drift hits both."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    while min(map(len, out.values())) < reps:
        for name, fn in fns.items():
            fn()  # the first call after a switch warms this path's connection again
            for _ in range(min(block, reps - len(out[name]))):
                start = time.perf_counter()
                fn()
                out[name].append(time.perf_counter() - start)
    return out


def pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1]


def all_cached(url: str, encoder: Encoder, args: argparse.Namespace) -> dict[str, Any]:
    direct, _ = new_client(url, args.redis)
    http, _ = new_client(url, None)
    images = [png(args.size, CACHED_SEED + i) for i in range(8)]
    direct.encode(images)
    encoder.delta()

    def run(client: Any) -> Callable[[], None]:
        def call() -> None:
            handles = client.encode(images)
            assert all(h.cached for h in handles)

        return call

    times = blocked({"direct store": run(direct), "HTTP /v1/probe": run(http)}, args.reps,
                    args.block)  # fmt: skip
    encoded, _ = encoder.delta()
    out = {name: {"p50": statistics.median(t) * 1e3, "p90": pct(t, 90) * 1e3, "n": len(t)}
           for name, t in times.items()}  # fmt: skip
    out["encoded"] = encoded
    out["kb"] = sum(map(len, images)) / 1e3
    d, h = out["direct store"], out["HTTP /v1/probe"]
    print(f"\n== 2. all-cached encode of 8 images ({out['kb']:.0f} KB), {args.reps} calls each, "
          f"blocks of {args.block}; images encoded meanwhile: {encoded}")  # fmt: skip
    print(f"{'probe':<16} {'p50 ms':>8} {'p90 ms':>8}")
    for name in ("direct store", "HTTP /v1/probe"):
        print(f"{name:<16} {out[name]['p50']:>8.3f} {out[name]['p90']:>8.3f}")
    print(f"HTTP / direct: p50 {h['p50'] / d['p50']:.1f}x, p90 {h['p90'] / d['p90']:.1f}x",
          flush=True)  # fmt: skip
    direct.close()
    http.close()
    return out


# -- 3. fetch_chunk vs raw GETRANGE ---------------------------------------------------------------
def fetch_bandwidth(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from vitserve.cache.codec import read_header, row_spans

    client, _ = new_client(url, args.redis)
    store = client.core.store
    images = [png(args.fetch_size, FETCH_SEED + i) for i in range(args.fetch_images)]
    handles = client.encode(images)
    offsets, _ = layout(handles, args.text_tokens)
    start, end = offsets[0], offsets[-1] + handles[-1].num_tokens

    raw = redis.Redis.from_url(args.redis)
    ranges = []  # (redis key, first byte, last byte) of every span the store reads
    for h in handles:
        vkey = store._vkey(store.full_key(h.key))  # the store's layout: {prefix}:v:{ns/key}
        header = read_header(raw.get(vkey))
        ranges += [(vkey, sp.start, sp.end - 1) for sp in row_spans(header, 0, h.num_tokens)]
    nbytes = sum(b - a + 1 for _, a, b in ranges)

    def raw_read() -> list[bytes]:
        pipe = raw.pipeline(transaction=False)
        for key, a, b in ranges:
            pipe.getrange(key, a, b)
        return pipe.execute()

    def sdk_read() -> Any:
        return client.fetch_chunk(handles, offsets, start, end)

    chunk = sdk_read()  # warm-up: the headers are cached from here on
    assert chunk.rows == sum(h.num_tokens for h in handles)
    assert sum(map(len, raw_read())) == nbytes
    before = store.stats()["bytes_read"]
    sdk_read()
    per_call = store.stats()["bytes_read"] - before
    t_raw, t_sdk, ratio = paired(raw_read, sdk_read, args.reps)
    verify = store.verify_payload
    store.verify_payload = False  # diagnostic: the same read without the block checksums
    t_raw2, t_nov, ratio_nov = paired(raw_read, sdk_read, args.reps)
    store.verify_payload = verify
    out = {"images": len(handles), "rows": chunk.rows, "nbytes": nbytes, "per_call": per_call,
           "width": handles[0].shape[1], "dtype": handles[0].dtype, "spans": len(ranges),
           "raw_ms": t_raw * 1e3, "sdk_ms": t_sdk * 1e3, "ratio": ratio,
           "raw2_ms": t_raw2 * 1e3, "nov_ms": t_nov * 1e3, "ratio_nov": ratio_nov}  # fmt: skip
    mb = nbytes / 1e6
    print(
        f"\n== 3. fetch_chunk vs raw redis-py GETRANGE pipeline: {out['images']} images of "
        f"{args.fetch_size}px, {out['rows']} rows x {out['width']} {out['dtype']}, "
        f"{nbytes / 2**20:.2f} MiB in {len(ranges)} spans; store bytes_read per fetch_chunk "
        f"{per_call:,} (raw spans {nbytes:,}); medians of {args.reps} alternating pairs"
    )
    print(f"{'read':<40} {'ms':>8} {'MB/s':>8} {'raw/this':>9}")
    print(f"{'raw pipeline of GETRANGE':<40} {t_raw * 1e3:>8.2f} {mb / t_raw:>8.0f} {'':>9}")
    print(f"{'client.fetch_chunk':<40} {t_sdk * 1e3:>8.2f} {mb / t_sdk:>8.0f} {ratio:>9.2f}")
    print(f"{'raw pipeline (again, paired below)':<40} {t_raw2 * 1e3:>8.2f} {mb / t_raw2:>8.0f}")
    print(f"{'fetch_chunk, checksums off (diagnostic)':<40} {t_nov * 1e3:>8.2f} "
          f"{mb / t_nov:>8.0f} {ratio_nov:>9.2f}", flush=True)  # fmt: skip
    raw.close()
    client.close()
    return out


# -- 4. TTFT through the prefill route ------------------------------------------------------------
def start_prefill(base_url: str, model: str, args: argparse.Namespace) -> str:
    """The prefill application beside the encoder's: same model, store and namespace, the
    encoder reached by its ingress's handle, rows read from the store directly; its URL."""
    from vitserve.deployments.config import VitserveConfig
    from vitserve.deployments.local import serve_app
    from vitserve.deployments.prefill import build_prefill_application

    fields: dict[str, Any] = {"model": model, "store": args.redis,
                              "namespace": f"bench-client-{os.getpid()}",
                              # 0.25 CPU: the encoder application holds 1.75 of the cluster's 2
                              "prefill": {"encoder_app": APP, "route_prefix": f"/{CHAT_APP}",
                                          "num_cpus": 0.25, "chunk_size": args.chunk,
                                          "direct_store": True}}  # fmt: skip
    if args.dtype:
        fields["dtype"] = args.dtype
    serve_app(build_prefill_application(VitserveConfig.load(fields)), name=CHAT_APP,
              route_prefix=f"/{CHAT_APP}")  # fmt: skip
    return f"{base_url}/{CHAT_APP}"


def data_url(image: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_body(urls: list[str], max_tokens: int) -> bytes:
    """Turn ``len(urls)``: user message k (text, image k), the fixed reply between them."""
    import json

    messages: list[dict[str, Any]] = []
    for k, url in enumerate(urls, 1):
        if k > 1:
            messages.append({"role": "assistant", "content": ASSISTANT_TEXT})
        messages.append({"role": "user", "content": [
            {"type": "text", "text": USER_TEXT.format(k=k)},
            {"type": "image_url", "image_url": {"url": url}}]})  # fmt: skip
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0, "max_tokens": max_tokens}  # fmt: skip
    return json.dumps(body).encode()


def stream_chat(http: Any, url: str, body: bytes) -> dict[str, Any]:
    """One streamed completion: seconds to the role chunk (``first_event``), to the first
    token's event (``ttft``; the finish event when no token came), to ``[DONE]``; the text and
    the usage."""
    import json

    out: dict[str, Any] = {"ttft": None, "text": "", "usage": None, "tokens": 0}
    start = time.perf_counter()
    with http.stream("POST", f"{url}/v1/chat/completions", content=body,
                     headers={"content-type": "application/json"}) as response:  # fmt: skip
        if response.status_code != 200:
            raise RuntimeError(f"chat: HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - start
            payload = line[6:]
            if payload == "[DONE]":
                out["done"] = now
                break
            event = json.loads(payload)
            if event.get("usage"):
                out["usage"] = event["usage"]
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            delta = choice["delta"]
            if "role" in delta:
                out["first_event"] = now
            elif "content" in delta or choice["finish_reason"] is not None:
                if out["ttft"] is None:
                    out["ttft"] = now
                    out["stopped_at_once"] = "content" not in delta
                if "content" in delta:
                    out["tokens"] += 1
                    out["text"] += delta["content"]
    assert out["usage"] is not None and out["ttft"] is not None, out
    return out


def chat_turns(base_url: str, encoder: Encoder, model: str,
               args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Part 4: the prefill application deployed, warmed up, then the turns (see the module
    docstring); per strategy, a row per turn."""
    import httpx

    started = time.perf_counter()
    url = start_prefill(base_url, model, args)
    deploy_s = time.perf_counter() - started
    http = httpx.Client(timeout=600)
    health = http.get(f"{url}/healthz").json()
    keys, _ = new_client(base_url, args.redis)  # computes the keys, deletes them (no cache)
    n = args.chat_turns
    images = {s: [png(args.size, CHAT_SEED_BASE[s] + t) for t in range(n)]
              for s in CHAT_STRATEGIES}  # fmt: skip
    urls = {s: [data_url(b) for b in images[s]] for s in CHAT_STRATEGIES}
    # warm-up: the prefill replica's first requests pay one-off costs (allocations, kernels)
    warm = [data_url(png(args.size, CHAT_WARM_SEED + i)) for i in range(3)]
    for k in (1, 2, 3):
        stream_chat(http, url, chat_body(warm[:k], args.max_tokens))
    encoder.delta()
    rows: dict[str, list[dict]] = {s: [] for s in CHAT_STRATEGIES}
    print(f"\n== 4. TTFT through the prefill route: {n} turns, {args.size}x{args.size} PNGs, "
          f"chunk {health['chunk_size']} tokens, max_tokens {args.max_tokens} (prefill app "
          f"deployed in {deploy_s:.1f} s)")  # fmt: skip
    print(f"{'strategy':<26} {'turn':>4} {'prompt':>6} {'upl':>4} {'enc':>4} {'encoder ms':>10} "
          f"{'rows':>5} {'chunks':>6} {'1st event ms':>12} {'TTFT ms':>8} {'done ms':>8}",
          flush=True)  # fmt: skip
    for turn in range(1, n + 1):
        order = CHAT_STRATEGIES[turn % 2 :] + CHAT_STRATEGIES[: turn % 2]  # alternate the first
        for strategy in order:
            if strategy == CHAT_STRATEGIES[1]:
                keys.core.store.delete(keys.core.keys_of(images[strategy][:turn]))
            body = chat_body(urls[strategy][:turn], args.max_tokens)
            encoder.delta()
            answer = stream_chat(http, url, body)
            n_encoded, forward_s = encoder.delta()
            u = answer["usage"]
            row = {"turn": turn, "images": turn, "ttft_ms": answer["ttft"] * 1e3,
                   "first_event_ms": answer["first_event"] * 1e3, "done_ms": answer["done"] * 1e3,
                   "encoded": n_encoded, "encoder_ms": forward_s * 1e3,
                   "stopped_at_once": answer["stopped_at_once"], "tokens": answer["tokens"],
                   "text": answer["text"],
                   **{k: u[k] for k in ("prompt_tokens", "images_sent", "images_uploaded",
                                        "images_encoded", "rows_pulled", "prefill_chunks",
                                        "completion_tokens")}}  # fmt: skip
            rows[strategy].append(row)
            print(f"{strategy:<26} {turn:>4} {row['prompt_tokens']:>6} "
                  f"{row['images_uploaded']:>4} {row['images_encoded']:>4} "
                  f"{row['encoder_ms']:>10.1f} {row['rows_pulled']:>5} "
                  f"{row['prefill_chunks']:>6} {row['first_event_ms']:>12.1f} "
                  f"{row['ttft_ms']:>8.1f} {row['done_ms']:>8.1f}", flush=True)  # fmt: skip
    keys.close()
    http.close()
    return {"rows": rows, "chunk": health["chunk_size"], "deploy_s": deploy_s,
            "threads": prefill_threads()}  # fmt: skip


def prefill_threads() -> str:
    """OMP_NUM_THREADS in the prefill replica's environment (Ray sets it per worker; torch
    sizes its intra-op pool by it), read from /proc: diagnostic only."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            if f"ServeReplica:{CHAT_APP}:PrefillServer".encode() not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0")
                       if b"=" in kv)  # fmt: skip
            return env.get(b"OMP_NUM_THREADS", b"unset").decode()
        except OSError:
            continue
    return "unknown"


def window_ratio(rows: list[dict], key: str) -> tuple[float, float]:
    """Last turn / first turn of ``key``, and the median of the last (up to) 4 turns over the
    median of the first (up to) 4."""
    k = min(4, len(rows))
    first, last = rows[0][key], rows[-1][key]
    head = statistics.median(r[key] for r in rows[:k])
    tail = statistics.median(r[key] for r in rows[-k:])
    return last / first if first else float("nan"), tail / head if head else float("nan")


# -- the report -----------------------------------------------------------------------------------
TURN_HEAD = ("| turn | images | bytes uploaded | images encoded | encoder ms "
             "| encode ms (end to end) | fetch ms |")  # fmt: skip
TOTALS_HEAD = ("| strategy | encoder time | end-to-end encode | fetch | images encoded "
               "| encoder ms per image encoded, turn 1 / last | images encoded (all turns) "
               "| bytes uploaded (all turns) |")  # fmt: skip


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report_turns(turns: dict[str, list[dict]], n: int) -> list[str]:
    lines = [f"## 1. Multi-turn probe: turns 1..{n}, each re-sending the conversation's images "
             "plus one new one", ""]  # fmt: skip
    for strategy, rows in turns.items():
        lines += [f"**{strategy}**", "", TURN_HEAD, "|---" * 7 + "|"]
        lines += [f"| {r['turn']} | {r['images']} | {r['uploaded']:,.0f} | {r['encoded']} | "
                  f"{r['encoder_ms']:.1f} | {r['encode_ms']:.1f} | {r['fetch_ms']:.2f} |"
                  for r in rows]  # fmt: skip
        lines.append("")
    lines += [
        f"Turn {n} / turn 1 (in brackets: the mean of the last 4 turns / the mean of the "
        "first 4), and the conversation's totals:",
        "",
        TOTALS_HEAD,
        "|---" * 8 + "|",
    ]
    for strategy, rows in turns.items():
        cells = []
        for key in ("encoder_ms", "encode_ms", "fetch_ms"):
            last, tail = turn_ratios(rows, key)
            cells.append(f"{last:.2f}x ({tail:.2f}x)")
        first, last = rows[0], rows[-1]
        cells.append(f"{last['encoded'] / max(first['encoded'], 1):.0f}x")
        per = [r["encoder_ms"] / r["encoded"] if r["encoded"] else float("nan")
               for r in (first, last)]  # fmt: skip
        cells.append(f"{per[0]:.1f} / {per[1]:.1f}")
        lines.append(f"| {strategy} | {' | '.join(cells)} | {sum(r['encoded'] for r in rows)} "
                     f"| {sum(r['uploaded'] for r in rows):,.0f} |")  # fmt: skip
    return [*lines, ""]


def report_cached(cached: dict, args: argparse.Namespace) -> list[str]:
    d, h = cached["direct store"], cached["HTTP /v1/probe"]
    return [f"## 2. All-cached `encode` of 8 images ({cached['kb']:.0f} KB of PNG), "
            f"{args.reps} calls each, interleaved in blocks of {args.block}", "",
            "| probe | p50 ms | p90 ms |", "|---|---|---|",
            f"| direct store (`store=\"{args.redis}\"`) | {d['p50']:.3f} | {d['p90']:.3f} |",
            f"| through the ingress (`POST /v1/probe`) | {h['p50']:.3f} | {h['p90']:.3f} |",
            f"| ingress / direct | {h['p50'] / d['p50']:.1f}x | {h['p90'] / d['p90']:.1f}x |",
            "", f"Images encoded during these calls: {cached['encoded']}.", ""]  # fmt: skip


def report_fetch(f: dict, args: argparse.Namespace) -> list[str]:
    mb = f["nbytes"] / 1e6
    return ["## 3. `fetch_chunk` vs a raw redis-py pipeline of `GETRANGE` over the same spans",
            "", f"{f['images']} images of {args.fetch_size}x{args.fetch_size}, {f['rows']} rows "
            f"x {f['width']} {f['dtype']}: {f['nbytes']:,} bytes in {f['spans']} spans "
            f"({f['nbytes'] / 2**20:.2f} MiB); one chunk covering every image, headers cached "
            f"(the store's `bytes_read` per call: {f['per_call']:,}). Medians of {args.reps} "
            "alternating pairs; ratio = median of the pairs' raw time / SDK time.", "",
            "| read | ms | MB/s | raw time / this time |", "|---|---|---|---|",
            f"| raw redis-py pipeline of GETRANGE | {f['raw_ms']:.2f} | "
            f"{mb / f['raw_ms'] * 1e3:.0f} | |",
            f"| `client.fetch_chunk` | {f['sdk_ms']:.2f} | {mb / f['sdk_ms'] * 1e3:.0f} | "
            f"{f['ratio']:.2f} |",
            f"| (diagnostic) `fetch_chunk` with the store's block checksums off, paired with "
            f"its own raw run ({f['raw2_ms']:.2f} ms) | {f['nov_ms']:.2f} | "
            f"{mb / f['nov_ms'] * 1e3:.0f} | {f['ratio_nov']:.2f} |", ""]  # fmt: skip


def both(a: Any, b: Any) -> str:
    """One figure when the two strategies agree, else ``a / b``."""
    return f"{a}" if a == b else f"{a} / {b}"


def chat_summary(chat: dict[str, Any]) -> dict[str, Any]:
    rows = chat["rows"]
    per, none = (rows[s] for s in CHAT_STRATEGIES)
    out: dict[str, Any] = {}
    for s in CHAT_STRATEGIES:
        r = rows[s]
        out[s] = {"ttft": window_ratio(r, "ttft_ms"), "encoder": window_ratio(r, "encoder_ms"),
                  "median_ttft": statistics.median(x["ttft_ms"] for x in r),
                  "encoded": sum(x["encoded"] for x in r),
                  "mismatch": sum(x["encoded"] != x["images_encoded"] for x in r),
                  "at_once": sum(x["stopped_at_once"] for x in r)}  # fmt: skip
    out["last"] = (per[-1], none[-1])
    out["flat"] = out[CHAT_STRATEGIES[0]]["encoder"][0] <= 1.2
    return out


def report_chat(chat: dict[str, Any], args: argparse.Namespace) -> list[str]:
    rows = chat["rows"]
    per, none = (rows[s] for s in CHAT_STRATEGIES)
    n = len(per)
    summ = chat_summary(chat)
    threads = chat["threads"]
    if threads == "unset":
        threads = "unset, so torch's pool is the machine's cores"
    default_chunk = (
        "the prefill config's default" if chat["chunk"] == 512 else "not the default 512"
    )
    lines = [
        f"## 4. TTFT per turn through the prefill route: per-image keys vs no cache, turns 1..{n}",
        "",
        f"The prefill application (`deployments/prefill.py`, route `/{CHAT_APP}`, one replica, "
        f"0.25 CPU; OMP_NUM_THREADS in its replica: {threads}) deployed after part 3 (in "
        f"{chat['deploy_s']:.0f} s) beside the encoder application: same model (its language "
        f"model only), same store and namespace, the encoder reached by its ingress's handle, "
        f"image rows read from the store directly; prefill chunks of {chat['chunk']} tokens "
        f"(`--chunk`; {default_chunk}). Turn t "
        f'sends user messages 1..t (`"{USER_TEXT.format(k="k")}"` and one {args.size}x'
        f'{args.size} PNG as a `data:` URL) with the fixed reply `"{ASSISTANT_TEXT}"` '
        f"between them (both strategies' prompts are the same length), `stream: true`, "
        f"`temperature: 0`, `max_tokens: {args.max_tokens}`. Per-image keys: nothing special "
        f"(the prefill replica's SDK hashes first and uploads only what the store lacks); no "
        f"cache: the conversation's keys deleted from the store before each turn (not timed). "
        f"Each strategy its own images, interleaved turn by turn, the order alternating.",
        "",
        "TTFT: from sending the request (body serialized beforehand) to the first SSE event "
        "after the role chunk, i.e. the first token's event (its text delta may be empty: the "
        "random-weight model's token may decode to nothing); the model stopping at once "
        "would count its finish event "
        f"(it did in {summ[CHAT_STRATEGIES[0]]['at_once']} / "
        f"{summ[CHAT_STRATEGIES[1]]['at_once']} turns). The server sends nothing before the "
        "prefill is done and picks the first token from its last logits, so TTFT covers the "
        "hash, probe, uploads, encoder forwards, per-chunk row reads and chunked prefill. "
        "Images encoded: the answer's `usage.images_encoded` (the encoder's `counters()` "
        f"disagreed in {summ[CHAT_STRATEGIES[0]]['mismatch']} / "
        f"{summ[CHAT_STRATEGIES[1]]['mismatch']} turns); encoder s: the encoder deployment's "
        "forward seconds during the request. One request per strategy and turn.",
        "",
        "| turn | images | prompt tokens | TTFT ms, per-image keys | TTFT ms, no cache "
        "| images encoded, per-image keys | images encoded, no cache "
        "| encoder s, per-image keys | encoder s, no cache | rows pulled | prefill chunks |",
        "|---" * 11 + "|",
    ]
    for a, b in zip(per, none, strict=True):
        lines.append(
            f"| {a['turn']} | {a['images']} | {both(a['prompt_tokens'], b['prompt_tokens'])} "
            f"| {a['ttft_ms']:.1f} | {b['ttft_ms']:.1f} | {a['images_encoded']} "
            f"| {b['images_encoded']} | {a['encoder_ms'] / 1e3:.3f} | {b['encoder_ms'] / 1e3:.3f} "
            f"| {both(a['rows_pulled'], b['rows_pulled'])} "
            f"| {both(a['prefill_chunks'], b['prefill_chunks'])} |"
        )
    a, b = summ["last"]
    lines += ["", f"Turn {n} / turn 1 (in brackets: the median of the last 4 turns / the median "
              "of the first 4):", "",
              "| strategy | TTFT | encoder time per turn | median TTFT, all turns (ms) "
              "| images encoded (all turns) |", "|---|---|---|---|---|"]  # fmt: skip
    for s in CHAT_STRATEGIES:
        t, e = summ[s]["ttft"], summ[s]["encoder"]
        lines.append(f"| {s} | {t[0]:.2f}x ({t[1]:.2f}x) | {e[0]:.2f}x ({e[1]:.2f}x) "
                     f"| {summ[s]['median_ttft']:.1f} | {summ[s]['encoded']} |")  # fmt: skip
    flat = "flat" if summ["flat"] else "**not flat**"
    e_per = summ[CHAT_STRATEGIES[0]]["encoder"][0]
    e_none = summ[CHAT_STRATEGIES[1]]["encoder"][0]
    lines += [
        "",
        f"Summary: TTFT turn {n} / turn 1 is {summ[CHAT_STRATEGIES[0]]['ttft'][0]:.2f}x with "
        f"per-image keys and {summ[CHAT_STRATEGIES[1]]['ttft'][0]:.2f}x with no cache; at turn "
        f"{n}, {a['ttft_ms']:.0f} ms vs {b['ttft_ms']:.0f} ms (no cache / per-image keys "
        f"{b['ttft_ms'] / a['ttft_ms']:.2f}x), of which the encoder's forward "
        f"{a['encoder_ms']:.0f} ms vs {b['encoder_ms']:.0f} ms. Encoder time per turn with "
        f"per-image keys: {flat} ({e_per:.2f}x turn {n} / turn 1, goal <= 1.2); with no cache "
        f"it grows {e_none:.1f}x.",
        "",
        "Reference point (the issue): per-image caching took a 32 x 720p request's TTFT from "
        "9.1 s to 4.8 s (1.9x) inside one LLM server. Here the images are "
        f"{args.size}x{args.size} ({per[0]['rows_pulled']} rows each) on a 2-CPU machine, "
        "and the cache lives in the shared store, outside the LLM server.",
        "",
    ]
    return lines


def report(turns: dict[str, list[dict]], cached: dict, fetch: dict, chat: dict,
           args: argparse.Namespace) -> str:  # fmt: skip
    n = args.turns
    lines = [*report_turns(turns, n), *report_cached(cached, args), *report_fetch(fetch, args),
             *report_chat(chat, args)]  # fmt: skip
    r_per = turn_ratios(turns[STRATEGIES[0]], "encoder_ms")[0]
    r_whole = turn_ratios(turns[STRATEGIES[1]], "encoder_ms")[0]
    d, h = cached["direct store"]["p50"], cached["HTTP /v1/probe"]["p50"]
    lines += ["## Goals", "",
              f"* per-image keys, encoder time turn {n} / turn 1 <= 1.2: {r_per:.2f}x "
              f"({verdict(r_per <= 1.2)}); the whole-set key, for comparison (~{n}x expected): "
              f"{r_whole:.1f}x",
              f"* all-cached 8 images, direct probe p50 <= 1 ms: {d:.3f} ms ({verdict(d <= 1)});"
              f" >= 10x faster than through the ingress: {h / d:.1f}x ({verdict(h / d >= 10)})",
              f"* fetch_chunk >= 0.9x a raw GETRANGE pipeline: {fetch['ratio']:.2f}x "
              f"({verdict(fetch['ratio'] >= 0.9)})"]  # fmt: skip
    e_chat = window_ratio(chat["rows"][CHAT_STRATEGIES[0]], "encoder_ms")[0]
    t_chat = [window_ratio(chat["rows"][s], "ttft_ms")[0] for s in CHAT_STRATEGIES]
    m = args.chat_turns
    lines += [
        f"* through the prefill route, per-image keys, encoder time turn {m} / turn 1 "
        f"<= 1.2: {e_chat:.2f}x ({verdict(e_chat <= 1.2)}); TTFT turn {m} / turn 1: "
        f"{t_chat[0]:.2f}x with per-image keys, {t_chat[1]:.2f}x with no cache",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--reps", type=int, default=200,
                        help="timed calls per side in parts 2 and 3")  # fmt: skip
    parser.add_argument("--block", type=int, default=20, help="calls per block in part 2")
    parser.add_argument("--size", type=int, default=224, help="side of the turns' images")
    parser.add_argument("--fetch-size", type=int, default=448)
    parser.add_argument("--fetch-images", type=int, default=24)
    parser.add_argument(
        "--text-tokens",
        type=int,
        default=8,
        help="text tokens before each image and at the end of the prompt",
    )
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        help="the model's dtype (default: the host's, bf16 where native)",
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14",
                        help="the store (its db is flushed at start)")  # fmt: skip
    parser.add_argument("--chat-turns", type=int,
                        help="turns of part 4 (default: --turns; the model's context is 4096 "
                             "tokens, a turn takes ~93 at 224px)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=4,
                        help="max_tokens of part 4's chat requests")  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["1", "2", "3", "4"])
    parser.add_argument("--out", help="write the results file (markdown) here")
    args = parser.parse_args()
    if args.chat_turns is None:
        args.chat_turns = args.turns
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import redis
    from redis.utils import HIREDIS_AVAILABLE

    from vitserve.encoder.testmodels import cached_model, is_cached

    started = time.perf_counter()
    load0 = os.getloadavg()
    server = redis.Redis.from_url(args.redis)
    server.flushdb()
    parser_name = "hiredis" if HIREDIS_AVAILABLE else "no hiredis: the pure-Python reply parser"
    redis_info = (f"redis-server {server.info('server')['redis_version']}, redis-py "
                  f"{redis.__version__} ({parser_name})")  # fmt: skip
    server.close()
    if not is_cached(FAMILY, PRESET):
        print(f"building the {FAMILY} {PRESET} model once...", flush=True)
    model = str(cached_model(FAMILY, PRESET))
    url, handle = start_app(args, model)
    encoder = Encoder(handle)
    probe, _ = new_client(url, args.redis)
    health = probe.describe()
    # warm-up: the first forwards of a process pay one-off costs (kernels, allocations)
    for n in (1, 2, 1):
        probe.encode([png(args.size, WARM_SEED + 10 * n + i) for i in range(n)])
    probe.close()
    encoder.delta()
    dtype = health["dtype"]
    how = "set by --dtype" if args.dtype else "the host default"
    print(f"model: {FAMILY} {PRESET} (ViT-B tower, random weights) at {model}, {dtype} ({how}) "
          f"on {health['device']}; store {args.redis} ({redis_info}); {os.cpu_count()} CPUs; "
          f"load average at start {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}",
          flush=True)  # fmt: skip

    turns = multi_turn(url, encoder, args) if "1" not in args.skip else {}
    cached = all_cached(url, encoder, args) if "2" not in args.skip else {}
    fetch = fetch_bandwidth(url, args) if "3" not in args.skip else {}
    chat = chat_turns(url, encoder, model, args) if "4" not in args.skip else {}
    load1 = os.getloadavg()
    elapsed = time.perf_counter() - started
    print(f"\nrun took {elapsed:.0f} s; load average at the end {load1[0]:.1f} / {load1[1]:.1f} "
          f"/ {load1[2]:.1f}")  # fmt: skip
    if args.skip:
        return
    table = report(turns, cached, fetch, chat, args)
    print("\n" + table)
    if args.out:
        info = machine()
        command = " ".join(sys.argv[1:])
        head = [
            f"# The client SDK in the multi-turn agent scenario ({time.strftime('%Y-%m-%d')})",
            "",
            "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()),
            f"(load average at start {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f}, at the "
            f"end {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}; the run took "
            f"{elapsed:.0f} s)",
            "",
            f"Command: `RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client.py "
            f"{command}`",
            "",
            f"Model: {FAMILY} `{PRESET}` (random weights, a ViT-B tower; embedding rows of "
            f"{fetch['width']}), {dtype} ({how}) on {health['device']}. One in-process "
            f"application (local Ray, 2 CPUs; Serve's HTTP proxy; the Redis store "
            f"`{args.redis}`, flushed at start; {redis_info}), and for part 4 the prefill "
            f"application beside it; turns' images {args.size}x{args.size} PNG.",
            "",
            "",
        ]  # fmt: skip
        Path(args.out).write_text("\n".join(head) + table)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
