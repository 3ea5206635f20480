"""TTFT per turn through the prefill route: per-image keys vs no cache, an agent's turns.

The prefill application (``deployments/prefill/app.py``, route ``/bench-chat``) is deployed
beside the encoder application of ``client_rig`` (same model, same Redis store and namespace,
the encoder reached by its ingress's handle, rows read from the store directly, ``--chunk``
tokens per prefill chunk). Turns 1..``--chat-turns`` of an agent conversation: turn t sends the
user messages 1..t (each a short text and one ``--size`` PNG as a ``data:`` URL) with a fixed
short assistant reply between them (the same text in every turn and strategy, so both
strategies' prompts have the same length), ``stream: true``, ``temperature: 0``,
``max_tokens: --max-tokens``. Two strategies, each with its own images, interleaved turn by
turn (the order alternating):

* *per-image keys (vitserve)*: nothing special: the prefill replica's SDK hashes the images
  first and uploads only the one its store lacks (the new one);
* *no cache*: before each turn (not timed) the conversation's keys are deleted from the store,
  so every image is uploaded and encoded again.

TTFT: from sending the request (body serialized beforehand) to the first SSE event after the
role chunk, the first token's event (its text delta, empty when the token decodes to none; if
the model stops at once, the finish event), read with httpx streaming. The service answers
nothing before the prefill is done (the role chunk follows it), and the first token is picked
from the prefill's last logits, so TTFT covers the encode (hash, probe, uploads, encoder
forwards), the per-chunk row reads and the chunked prefill. Per turn also: the answer's
``usage`` (images uploaded / encoded, rows pulled, prompt tokens, chunks) and the encoder
deployment's ``counters()`` deltas (images, forward seconds).

Invariants:

* Both strategies send the same prompts (same length, same chunks); only the store differs.
* The answer's ``usage.images_encoded`` is checked against the encoder's own counters every
  turn (the page counts the turns where they disagree).
* Goal: per-image keys, encoder time turn N / turn 1 <= 1.2.

    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_chat.py \\
        --out loadtest/results/client-chat-cpu.md
    RAY_AUTH_MODE=disabled .venv/bin/python loadtest/bench_client_chat.py --chat-turns 4
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_rig import (
    APP,
    Encoder,
    add_common_args,
    finish,
    namespace,
    new_client,
    png,
    start,
    verdict,
)

CHAT_APP = "bench-chat"  # the prefill application, at route /bench-chat
CHAT_STRATEGIES = ("per-image keys (vitserve)", "no cache")
CHAT_SEED_BASE = {CHAT_STRATEGIES[0]: 40_000_000, CHAT_STRATEGIES[1]: 60_000_000}
CHAT_WARM_SEED = 93_000_000
USER_TEXT = "Step {k}: what now?"  # user message k: this text, then its image
ASSISTANT_TEXT = "Click next."  # the assistant's reply between turns (fixed: same prompts)


def start_prefill(base_url: str, model: str, args: argparse.Namespace) -> str:
    """The prefill application beside the encoder's: same model, store and namespace, the
    encoder reached by its ingress's handle, rows read from the store directly; its URL."""
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.prefill.app import build_prefill_application
    from vitserve.deployments.runner.local import serve_app

    fields: dict[str, Any] = {
        "model": model,
        "store": args.redis,
        "namespace": namespace(),
        # 0.25 CPU: the encoder application holds 1.75 of the cluster's 2
        "prefill": {
            "encoder_app": APP,
            "route_prefix": f"/{CHAT_APP}",
            "num_cpus": 0.25,
            "chunk_size": args.chunk,
            "direct_store": True,
        },
    }
    if args.dtype:
        fields["dtype"] = args.dtype
    serve_app(
        build_prefill_application(VitserveConfig.load(fields)),
        name=CHAT_APP,
        route_prefix=f"/{CHAT_APP}",
    )
    return f"{base_url}/{CHAT_APP}"


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat_body(urls: list[str], max_tokens: int) -> bytes:
    """Turn ``len(urls)``: user message k (text, image k), the fixed reply between them."""
    messages: list[dict[str, Any]] = []
    for k, url in enumerate(urls, 1):
        if k > 1:
            messages.append({"role": "assistant", "content": ASSISTANT_TEXT})
        content = [
            {"type": "text", "text": USER_TEXT.format(k=k)},
            {"type": "image_url", "image_url": {"url": url}},
        ]
        messages.append({"role": "user", "content": content})
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    return json.dumps(body).encode()


def stream_chat(http: httpx.Client, url: str, body: bytes) -> dict[str, Any]:
    """One streamed completion: seconds to the role chunk (``first_event``), to the first
    token's event (``ttft``; the finish event when no token came), to ``[DONE]``; the text and
    the usage."""
    out: dict[str, Any] = {"ttft": None, "text": "", "usage": None, "tokens": 0}
    start_s = time.perf_counter()
    with http.stream(
        "POST",
        f"{url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat: HTTP {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - start_s
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


def chat_turns(
    base_url: str, encoder: Encoder, model: str, args: argparse.Namespace
) -> dict[str, Any]:
    """The prefill application deployed, warmed up, then the turns (see the module
    docstring); per strategy, a row per turn."""
    started = time.perf_counter()
    url = start_prefill(base_url, model, args)
    deploy_s = time.perf_counter() - started
    http = httpx.Client(timeout=600)
    health = http.get(f"{url}/healthz").json()
    keys, _ = new_client(base_url, args.redis)  # computes the keys, deletes them (no cache)
    n = args.chat_turns
    images = {s: [png(args.size, CHAT_SEED_BASE[s] + t) for t in range(n)] for s in CHAT_STRATEGIES}
    urls = {s: [data_url(b) for b in images[s]] for s in CHAT_STRATEGIES}
    # warm-up: the prefill replica's first requests pay one-off costs (allocations, kernels)
    warm = [data_url(png(args.size, CHAT_WARM_SEED + i)) for i in range(3)]
    for k in (1, 2, 3):
        stream_chat(http, url, chat_body(warm[:k], args.max_tokens))
    encoder.delta()
    rows: dict[str, list[dict]] = {s: [] for s in CHAT_STRATEGIES}
    print(
        f"\n== TTFT through the prefill route: {n} turns, {args.size}x{args.size} PNGs, "
        f"chunk {health['chunk_size']} tokens, max_tokens {args.max_tokens} (prefill app "
        f"deployed in {deploy_s:.1f} s)"
    )
    print(
        f"{'strategy':<26} {'turn':>4} {'prompt':>6} {'upl':>4} {'enc':>4} {'encoder ms':>10} "
        f"{'rows':>5} {'chunks':>6} {'1st event ms':>12} {'TTFT ms':>8} {'done ms':>8}",
        flush=True,
    )
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
            row = {
                "turn": turn,
                "images": turn,
                "ttft_ms": answer["ttft"] * 1e3,
                "first_event_ms": answer["first_event"] * 1e3,
                "done_ms": answer["done"] * 1e3,
                "encoded": n_encoded,
                "encoder_ms": forward_s * 1e3,
                "stopped_at_once": answer["stopped_at_once"],
                "tokens": answer["tokens"],
                "text": answer["text"],
                **{
                    k: u[k]
                    for k in (
                        "prompt_tokens",
                        "images_sent",
                        "images_uploaded",
                        "images_encoded",
                        "rows_pulled",
                        "prefill_chunks",
                        "completion_tokens",
                    )
                },
            }
            rows[strategy].append(row)
            print(
                f"{strategy:<26} {turn:>4} {row['prompt_tokens']:>6} "
                f"{row['images_uploaded']:>4} {row['images_encoded']:>4} "
                f"{row['encoder_ms']:>10.1f} {row['rows_pulled']:>5} "
                f"{row['prefill_chunks']:>6} {row['first_event_ms']:>12.1f} "
                f"{row['ttft_ms']:>8.1f} {row['done_ms']:>8.1f}",
                flush=True,
            )
    keys.close()
    http.close()
    return {
        "rows": rows,
        "chunk": health["chunk_size"],
        "deploy_s": deploy_s,
        "threads": prefill_threads(),
    }


def prefill_threads() -> str:
    """OMP_NUM_THREADS in the prefill replica's environment (Ray sets it per worker; torch
    sizes its intra-op pool by it), read from /proc: diagnostic only."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            if f"ServeReplica:{CHAT_APP}:PrefillServer".encode() not in cmd:
                continue
            environ = (proc / "environ").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in environ if b"=" in kv)
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


def both(a: Any, b: Any) -> str:
    """One figure when the two strategies agree, else ``a / b``."""
    return f"{a}" if a == b else f"{a} / {b}"


def chat_summary(chat: dict[str, Any]) -> dict[str, Any]:
    rows = chat["rows"]
    per, none = (rows[s] for s in CHAT_STRATEGIES)
    out: dict[str, Any] = {}
    for s in CHAT_STRATEGIES:
        r = rows[s]
        out[s] = {
            "ttft": window_ratio(r, "ttft_ms"),
            "encoder": window_ratio(r, "encoder_ms"),
            "median_ttft": statistics.median(x["ttft_ms"] for x in r),
            "encoded": sum(x["encoded"] for x in r),
            "mismatch": sum(x["encoded"] != x["images_encoded"] for x in r),
            "at_once": sum(x["stopped_at_once"] for x in r),
        }
    out["last"] = (per[-1], none[-1])
    out["flat"] = out[CHAT_STRATEGIES[0]]["encoder"][0] <= 1.2
    return out


def report(chat: dict[str, Any], args: argparse.Namespace) -> str:
    rows = chat["rows"]
    per, none = (rows[s] for s in CHAT_STRATEGIES)
    n = len(per)
    summ = chat_summary(chat)
    keys_s, none_s = summ[CHAT_STRATEGIES[0]], summ[CHAT_STRATEGIES[1]]
    threads = chat["threads"]
    if threads == "unset":
        threads = "unset, so torch's pool is the machine's cores"
    default_chunk = (
        "the prefill config's default" if chat["chunk"] == 512 else "not the default 512"
    )
    lines = [
        f"## TTFT per turn through the prefill route: per-image keys vs no cache, turns 1..{n}",
        "",
        f"The prefill application (`deployments/prefill/app.py`, route `/{CHAT_APP}`, one "
        f"replica, 0.25 CPU; OMP_NUM_THREADS in its replica: {threads}) deployed after the "
        f"encoder application's warm-up (in {chat['deploy_s']:.0f} s) beside it: same model "
        f"(its language model only), same store and namespace, the encoder reached by its "
        f"ingress's handle, image rows read from the store directly; prefill chunks of "
        f"{chat['chunk']} tokens (`--chunk`; {default_chunk}). Turn t "
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
        f"would count its finish event (it did in {keys_s['at_once']} / "
        f"{none_s['at_once']} turns). The server sends nothing before the "
        "prefill is done and picks the first token from its last logits, so TTFT covers the "
        "hash, probe, uploads, encoder forwards, per-chunk row reads and chunked prefill. "
        "Images encoded: the answer's `usage.images_encoded` (the encoder's `counters()` "
        f"disagreed in {keys_s['mismatch']} / {none_s['mismatch']} turns); encoder s: the "
        "encoder deployment's forward seconds during the request. One request per strategy "
        "and turn.",
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
    lines += [
        "",
        f"Turn {n} / turn 1 (in brackets: the median of the last 4 turns / the median "
        "of the first 4):",
        "",
        "| strategy | TTFT | encoder time per turn | median TTFT, all turns (ms) "
        "| images encoded (all turns) |",
        "|---|---|---|---|---|",
    ]
    for s in CHAT_STRATEGIES:
        t, e = summ[s]["ttft"], summ[s]["encoder"]
        lines.append(
            f"| {s} | {t[0]:.2f}x ({t[1]:.2f}x) | {e[0]:.2f}x ({e[1]:.2f}x) "
            f"| {summ[s]['median_ttft']:.1f} | {summ[s]['encoded']} |"
        )
    flat = "flat" if summ["flat"] else "**not flat**"
    e_per, e_none = keys_s["encoder"][0], none_s["encoder"][0]
    t_per, t_none = keys_s["ttft"][0], none_s["ttft"][0]
    lines += [
        "",
        f"Summary: TTFT turn {n} / turn 1 is {t_per:.2f}x with per-image keys and "
        f"{t_none:.2f}x with no cache; at turn {n}, {a['ttft_ms']:.0f} ms vs "
        f"{b['ttft_ms']:.0f} ms (no cache / per-image keys {b['ttft_ms'] / a['ttft_ms']:.2f}x), "
        f"of which the encoder's forward {a['encoder_ms']:.0f} ms vs {b['encoder_ms']:.0f} ms. "
        f"Encoder time per turn with per-image keys: {flat} ({e_per:.2f}x turn {n} / turn 1, "
        f"goal <= 1.2); with no cache it grows {e_none:.1f}x.",
        "",
        "Reference point (the issue): per-image caching took a 32 x 720p request's TTFT from "
        "9.1 s to 4.8 s (1.9x) inside one LLM server. Here the images are "
        f"{args.size}x{args.size} ({per[0]['rows_pulled']} rows each) on a 2-CPU machine, "
        "and the cache lives in the shared store, outside the LLM server.",
        "",
        "## Goals",
        "",
        f"* through the prefill route, per-image keys, encoder time turn {n} / turn 1 "
        f"<= 1.2: {e_per:.2f}x ({verdict(e_per <= 1.2)}); TTFT turn {n} / turn 1: "
        f"{t_per:.2f}x with per-image keys, {t_none:.2f}x with no cache",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--chat-turns",
        type=int,
        default=32,
        help="turns (the model's context is 4096 tokens, a turn takes ~93 at 224px)",
    )
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--max-tokens", type=int, default=4, help="max_tokens of the requests")
    add_common_args(parser)
    args = parser.parse_args()
    rig = start(args)
    chat = chat_turns(rig.url, rig.encoder, rig.model, args)
    finish(
        rig,
        args,
        "The client SDK behind the prefill route: TTFT per turn of an agent conversation",
        f", and the prefill application beside it; turns' images {args.size}x{args.size} PNG",
        report(chat, args),
    )


if __name__ == "__main__":
    main()
