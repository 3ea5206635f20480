"""``vitserve demo``: the whole service path on a random-weight model, offline, then exit.

Starts the embedded default (local Ray, node-local store, no Redis) serving the demo model (or
``--model``), sends a mixed-resolution set of generated images through the HTTP API twice, and
prints each image's key and token count, the tower forwards the encoder formed, whether the
second pass was served from the store, and timings. While a pass runs (tens of seconds on a
slow CPU), it prints the encoder's progress as images leave the tower. It ends with a short
multi-turn chat through the prefill application (the whole conversation re-sent each turn, one
new image per turn), printing per turn what was uploaded, encoded and pulled, the answer and
its token ids.

The demo model's weights are random and most of its vocabulary is special filler tokens
(``<unused…>``), which an answer's text leaves out: its answers read as ``''``. So its chat asks
for ``min_tokens`` (the end token held back for ``CHAT_MAX_TOKENS`` tokens) and
``skip_special_tokens: false``, and the output says plainly that the text is noise. A
``--model`` of the user's is asked plainly.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import time
from collections.abc import Callable
from typing import Any

import httpx
from ray import serve

from vitserve.cache.urls import redact_url
from vitserve.deployments.common.serving import DEMO_FAMILY, DEMO_MODEL, DEMO_PRESET
from vitserve.deployments.runner.local import APP_NAME, local_config, start_local, stop_local
from vitserve.encoder.device import describe_cpu
from vitserve.testing.images import make_image
from vitserve.testing.models import is_cached

PROGRESS_PERIOD_S = 1.0
# The chat's turns: a question and a new image each (width, height); the answers are the
# random-weight model's, so they read as noise.
CHAT_TURNS = [
    ("What is in this picture?", (448, 448)),
    ("And how does this one differ?", (640, 480)),
    ("Which of the pictures is brightest?", (448, 448)),
]
CHAT_MAX_TOKENS = 8

# (width, height, mode, format): a mixed-resolution request, with one image sent twice.
DEMO_IMAGES = [
    (448, 448, "RGB", "JPEG"),
    (448, 448, "RGB", "PNG"),
    (448, 448, "L", "PNG"),
    (333, 517, "RGBA", "PNG"),
    (640, 480, "RGB", "WEBP"),
    (1280, 720, "RGB", "JPEG"),
]


def demo_images() -> list[tuple[str, bytes]]:
    images = [
        (f"{w}x{h} {mode} {fmt}", make_image(w, h, mode=mode, fmt=fmt, seed=i))
        for i, (w, h, mode, fmt) in enumerate(DEMO_IMAGES)
    ]
    return [*images, images[0]]  # the first image again: one key, encoded once


def _post(url: str, images: list[tuple[str, bytes]]) -> tuple[dict[str, Any], float]:
    files = [
        ("images", (f"{i}.img", data, "application/octet-stream"))
        for i, (_, data) in enumerate(images)
    ]
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/encode", files=files, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return response.json(), elapsed


def _post_with_progress(
    url: str,
    images: list[tuple[str, bytes]],
    encoder: Any,
    start: dict[str, Any],
    echo: Callable[[str], None],
) -> tuple[dict[str, Any], float]:
    """``_post``, printing the encoder's progress since its counters were ``start`` (images
    through the tower, forwards) every ``PROGRESS_PERIOD_S`` while the request runs."""
    seen = start["images"]
    with cf.ThreadPoolExecutor(1) as pool:
        request = pool.submit(_post, url, images)
        began = time.perf_counter()
        while True:
            try:
                return request.result(timeout=PROGRESS_PERIOD_S)
            except cf.TimeoutError:
                now = encoder.counters.remote().result()
                if now["images"] != seen:
                    seen = now["images"]
                    images_done = seen - start["images"]
                    forwards = now["forward_calls"] - start["forward_calls"]
                    echo(
                        f"  ... {_count(images_done, 'image')} through the tower in "
                        f"{_count(forwards, 'forward')}, "
                        f"{time.perf_counter() - began:.1f} s"
                    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _batch_cap_line(info: dict[str, Any], cfg: Any) -> str:
    cap = info["max_batch_patches"]
    if cap is None:
        return "batch cap: none (a GPU takes whole batches under its memory budget)"
    if cfg.batching.max_batch_patches is not None:
        source = "set by batching.max_batch_patches"
    else:  # the engine's CPU default (see vitserve.encoder.device)
        source = f"sized to the CPU's cache: {describe_cpu()}"
    return f"batch cap: {cap} patches per forward ({source}); an image over it runs alone"


def run_demo(overrides: dict[str, Any], *, echo: Callable[[str], None] = print) -> None:
    cfg = local_config({"http_port": 0, **overrides})
    if cfg.model == DEMO_MODEL and not is_cached(DEMO_FAMILY, DEMO_PRESET):
        echo("building the demo model once (random weights, Qwen2-VL with a ViT-B tower)...")
    started = time.perf_counter()
    url = start_local(cfg, prefill=True)
    try:
        encoder = serve.get_deployment_handle("EncoderDeployment", app_name=APP_NAME)
        info = encoder.describe.remote().result()
        store = redact_url(cfg.store)  # never the password
        echo(
            f"serving {info['family']} ({info['dtype']} on {info['device']}) at {url}, "
            f"store {store}, started in {time.perf_counter() - started:.1f} s"
        )
        echo(_batch_cap_line(info, cfg))

        images = demo_images()
        for attempt in ("first", "second"):
            distinct = len({data for _, data in images})
            echo(
                f"\nPOST /v1/encode: {len(images)} images ({distinct} distinct) in one "
                f"request: {', '.join(name for name, _ in images)}"
            )
            before = encoder.counters.remote().result()
            body, elapsed = _post_with_progress(url, images, encoder, before, echo)
            after = encoder.counters.remote().result()
            forwards = after["forward_calls"] - before["forward_calls"]
            echo(
                f"\n{attempt} pass: {len(images)} images in {elapsed:.2f} s over HTTP, "
                f"{after['images'] - before['images']} through the tower in {forwards} "
                f"forwards"
            )
            echo(f"{'#':>2}  {'input':<17} {'key':<18} {'grid':<9} {'tokens':>6}  source")
            for i, ((name, _), item) in enumerate(zip(images, body["items"], strict=True)):
                if "error" in item:
                    echo(f"{i:>2}  {name:<17} error: {item['error']['message']}")
                    continue
                grid = "x".join(map(str, item["grid"])) if item["grid"] else "-"
                source = "store (cached)" if item["cached"] else "encoded"
                echo(
                    f"{i:>2}  {name:<17} {item['key'][:16]}.. {grid:<9} "
                    f"{item['num_tokens']:>6}  {source}"
                )
            buckets = {
                k: v - before["forward_calls_by_bucket"].get(k, 0)
                for k, v in after["forward_calls_by_bucket"].items()
                if v != before["forward_calls_by_bucket"].get(k, 0)
            }
            if buckets:
                echo(f"forwards per bucket: {buckets}")
        key = body["items"][0]["key"]
        record = httpx.get(f"{url}/v1/embeddings/{key}", timeout=60)
        echo(
            f"\nGET /v1/embeddings/{key[:16]}..: {record.status_code}, "
            f"{len(record.content)} bytes in the record format"
        )
        chat(
            f"{url}{cfg.prefill.route_prefix}",
            cfg.prefill.chunk_size,
            echo,
            random_weights=cfg.model == DEMO_MODEL,
        )
    finally:
        stop_local()


def chat(
    url: str,
    chunk_size: int,
    echo: Callable[[str], None],
    *,
    random_weights: bool = False,
) -> None:
    """A few chat turns through the prefill application at ``url``: each re-sends the whole
    conversation with one new image; per turn, what was uploaded, encoded and pulled, the
    answer and its token ids. ``random_weights``: the model's text is noise; say so, and hold
    its end token back so each answer has ``CHAT_MAX_TOKENS`` tokens to show."""
    echo(
        f"\nPOST {url}/v1/chat/completions: {len(CHAT_TURNS)} turns, the whole "
        f"conversation re-sent each turn, one new image per turn, prefill chunks of "
        f"{chunk_size} tokens"
    )
    options: dict[str, Any] = {"temperature": 0, "max_tokens": CHAT_MAX_TOKENS}
    if random_weights:
        options |= {"min_tokens": CHAT_MAX_TOKENS, "skip_special_tokens": False}
        echo(
            "the demo model's weights are random: its answers are noise. Each turn asks for "
            f"min_tokens={CHAT_MAX_TOKENS} (its end token held back) and "
            "skip_special_tokens=false (most of its vocabulary is <unused...> fillers)"
        )
    echo(
        f"{'turn':>4} {'sent':>4} {'uploaded':>8} {'encoded':>7} {'prompt':>6} {'rows':>5} "
        f"{'chunks':>6} {'time':>7}  answer"
    )
    messages: list[dict[str, Any]] = []
    for turn, (question, (w, h)) in enumerate(CHAT_TURNS, start=1):
        image = make_image(w, h, fmt="PNG", seed=100 + turn)
        url_of = "data:image/png;base64," + base64.b64encode(image).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url_of}},
            {"type": "text", "text": question},
        ]
        messages.append({"role": "user", "content": content})
        body = {"messages": messages, "return_token_ids": True, **options}
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", timeout=600, json=body)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            echo(f"{turn:>4} error {response.status_code}: {response.text[:200]}")
            response.raise_for_status()
        answer = response.json()
        u = answer["usage"]
        choice = answer["choices"][0]
        text = choice["message"]["content"]
        echo(
            f"{turn:>4} {u['images_sent']:>4} {u['images_uploaded']:>8} "
            f"{u['images_encoded']:>7} {u['prompt_tokens']:>6} {u['rows_pulled']:>5} "
            f"{u['prefill_chunks']:>6} {elapsed:>6.2f}s  {text[:40]!r}"
        )
        echo(f"{'':>10}token ids {choice['token_ids']} ({choice['finish_reason']})")
        messages.append({"role": "assistant", "content": text})
    echo(
        "each turn uploaded and encoded only its new image; the earlier ones came from the "
        "store by key (their rows pulled chunk by chunk)"
    )
