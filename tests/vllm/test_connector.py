"""vLLM with vitserve as its encoder tier, against vLLM alone: real servers (see conftest.py).

"vLLM alone" is replica A answering a request without ``uuid`` s: its items are keyed by vLLM's
own hash, miss in vitserve's store, and vLLM encodes them with its own tower. Through the front
(or with the keys as ``uuid`` s) the same images come from vitserve. Replica B's vision weights
are noise, so B gives A's answer only if its tower never runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest

from .chat import (
    LOGPROB_TOL,
    answer,
    body,
    delta,
    image_part,
    keys_of,
    logprob_gap,
    mp4,
    png,
    post,
    tokens,
    user,
    video_part,
)
from .conftest import SERVED_NAME, Replica, Vitserve


# -- equal to vLLM alone ---------------------------------------------------------------------
def test_the_front_gives_vllm_alones_answer_on_both_replicas(
    vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    """Two new images of different sizes: vLLM alone (A, its own tower) and the front (once to
    each replica: round robin) give the same greedy tokens and prompt logprobs; each replica
    loaded both images from vitserve and ran no fallback."""
    rng = np.random.default_rng(1)
    images = [png(rng, 224, 224), png(rng, 112, 168)]
    a, b = replicas["a"], replicas["b"]
    alone = answer(post(a.url, body([user(images)])))
    before = {name: r.counts() for name, r in replicas.items()}
    first = post(vitserve.front, body([user(images)]))
    second = post(vitserve.front, body([user(images)]))
    assert first.headers["x-vitserve-uploaded"] == "2"  # new to vitserve: uploaded, encoded
    assert second.headers["x-vitserve-cached"] == "2"  # then held: not uploaded again
    served = {first.headers["x-vitserve-vllm"], second.headers["x-vitserve-vllm"]}
    assert served == {"0", "1"}  # round robin: one each (their index in vllm.urls, not a URL)
    for doc in (answer(first), answer(second)):
        assert tokens(doc) == tokens(alone)
        gap = logprob_gap(doc, alone)
        print(f"{doc['id']}: max |prompt logprob difference| from vLLM alone {gap:.2g}")
        assert gap < LOGPROB_TOL, gap
    for name, replica in (("a", a), ("b", b)):
        moved = delta(before[name], replica.counts())
        assert moved["loads"] == 2 and moved["load_fallbacks"] == 0, (name, moved)
        assert moved["load_bytes"] > 0


def test_vllms_tower_never_runs_on_a_hit(vitserve: Vitserve, replicas: dict[str, Replica]) -> None:
    """Replica B's vision weights are noise: with vitserve's keys it gives vLLM alone's tokens
    and prompt logprobs; the control, the same request without keys (B's own tower), gives
    other tokens and prompt logprobs far from them."""
    rng = np.random.default_rng(2)
    images = [png(rng, 168, 112), png(rng, 224, 224)]
    alone = answer(post(replicas["a"].url, body([user(images)])))
    keys = keys_of(vitserve.url, images)
    hit = answer(post(replicas["b"].url, body([user(images, uuids=keys)])))
    control = answer(post(replicas["b"].url, body([user(images)])))
    hit_gap, control_gap = logprob_gap(hit, alone), logprob_gap(control, alone)
    print(
        f"max |prompt logprob difference| from vLLM alone: B with keys {hit_gap:.2g}, "
        f"B's own tower {control_gap:.2g}"
    )
    assert tokens(hit) == tokens(alone)
    assert hit_gap < LOGPROB_TOL, hit_gap
    assert tokens(control) != tokens(alone)
    assert control_gap > 100 * LOGPROB_TOL, control_gap


def test_a_video_through_the_front_gives_vllm_alones_answer(
    vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    """A ``video_url`` part (40 frames of 112x84 at 10 fps: vLLM's Qwen2-VL loader samples 8,
    as vitserve does; frames its processor does not resize): vLLM alone (A, its own tower) and
    the front (once to each replica) give the same greedy tokens and prompt logprobs, each
    replica loading the video's rows from vitserve; B's noise tower without the key (the
    control) answers far from them."""
    rng = np.random.default_rng(11)
    clip = mp4(rng, 40, 112, 84)
    messages = [{"role": "user", "content": [video_part(clip), {"type": "text", "text": "And?"}]}]
    a, b = replicas["a"], replicas["b"]
    alone = answer(post(a.url, body(messages)))
    before = {name: r.counts() for name, r in replicas.items()}
    first = post(vitserve.front, body(messages))
    second = post(vitserve.front, body(messages))
    assert first.headers["x-vitserve-uploaded"] == "1"
    assert second.headers["x-vitserve-cached"] == "1"
    assert {first.headers["x-vitserve-vllm"], second.headers["x-vitserve-vllm"]} == {"0", "1"}
    for doc in (answer(first), answer(second)):
        gap = logprob_gap(doc, alone)
        print(f"video through the front: max |prompt logprob difference| {gap:.2g}")
        assert tokens(doc) == tokens(alone)
        assert gap < LOGPROB_TOL, gap
    for name, replica in (("a", a), ("b", b)):
        moved = delta(before[name], replica.counts())
        assert moved["loads"] == 1 and moved["load_fallbacks"] == 0, (name, moved)
    control = answer(post(b.url, body(messages)))
    control_gap = logprob_gap(control, alone)
    print(f"B's own (noise) tower on the video: {control_gap:.2g}")
    assert control_gap > 100 * LOGPROB_TOL, control_gap


# -- shared across replicas --------------------------------------------------------------------
def test_a_conversation_alternating_replicas_encodes_one_image_per_turn(
    vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    """12 turns through the front, each re-sending the whole history with one new image; turns
    alternate between A and B. vitserve encodes one image per turn and the front uploads one;
    the last turn's answer is vLLM alone's (A without keys, the same messages)."""
    rng = np.random.default_rng(3)
    messages: list[dict[str, Any]] = []
    encoded = vitserve.encoded()  # with earlier tests' encodes
    before = {name: r.counts() for name, r in replicas.items()}
    for turn in range(1, 13):
        messages.append(user([png(rng, 112, 112)], text=f"Turn {turn}: what is new?"))
        response = post(vitserve.front, body(messages, max_tokens=4))
        doc = answer(response)
        assert response.headers["x-vitserve-images"] == str(turn)
        assert response.headers["x-vitserve-uploaded"] == "1", turn
        assert response.headers["x-vitserve-cached"] == str(turn - 1), turn
        now = vitserve.encoded()  # counted before the encode answered: exact at once
        assert now - encoded == 1, (turn, now - encoded)
        encoded = now
        messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
    last = messages[:-1]
    for name, replica in replicas.items():  # every image from vitserve: neither tower ran
        moved = delta(before[name], replica.counts())
        assert moved["loads"] > 0 and moved["misses"] == 0, (name, moved)
        assert moved["load_fallbacks"] == 0, (name, moved)
    alone = answer(post(replicas["a"].url, body(last, max_tokens=4)))
    assert tokens(doc) == tokens(alone)


# -- faults ------------------------------------------------------------------------------------
def _worker_pid(replica: Replica) -> int:
    """The pid of the replica's model worker (vLLM's ``VLLM::Worker`` process)."""
    import psutil

    assert replica.server.proc is not None
    tree = psutil.Process(replica.server.proc.pid).children(recursive=True)
    workers = [p for p in tree if "Worker" in p.name() or "Worker" in " ".join(p.cmdline())]
    assert len(workers) == 1, [(p.pid, p.name(), p.cmdline()[:3]) for p in tree]
    return workers[0].pid


def _getranges(store: Any) -> int:
    import redis

    stats = redis.Redis.from_url(store.url).info("commandstats")
    return int(stats.get("cmdstat_getrange", {}).get("calls", 0))


def _delete_keys(store: Any, keys: list[str]) -> int:
    import redis

    client = redis.Redis.from_url(store.url)
    names = [n for k in keys for n in client.scan_iter(match=f"*{k}*")]
    return client.delete(*names) if names else 0


def test_an_entry_evicted_between_probe_and_load_is_encoded_by_vllm(
    vitserve: Vitserve, replicas: dict[str, Replica], store: Any
) -> None:
    """A's model worker is stopped; the request arrives and A's scheduler probes the store
    (hits); the entries are deleted; the worker goes on and cannot load them: vLLM encodes
    them itself in the same step, and the answer is vLLM alone's. A keeps serving."""
    a = replicas["a"]
    rng = np.random.default_rng(4)
    images = [png(rng, 224, 224), png(rng, 112, 168)]
    alone = answer(post(a.url, body([user(images)])))
    keys = keys_of(vitserve.url, images)
    before = a.counts()
    pid = _worker_pid(a)
    reads = _getranges(store)
    result: dict[str, httpx.Response] = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(
            target=lambda: result.setdefault("r", post(a.url, body([user(images, uuids=keys)])))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while _getranges(store) == reads:  # the scheduler's probe: GETRANGE of the heads
            assert time.monotonic() < deadline, "the scheduler never probed the store"
            time.sleep(0.05)
        assert _delete_keys(store, keys) == 2
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(120)
    moved = delta(before, a.counts())
    assert tokens(answer(result["r"])) == tokens(alone)
    assert moved["hits"] == 2 and moved["load_fallbacks"] == 2 and moved["loads"] == 0, moved
    again = answer(post(a.url, body([user(images)])))
    assert tokens(again) == tokens(alone)


def test_the_store_down_for_one_request(
    vitserve: Vitserve, replicas: dict[str, Replica], store: Any
) -> None:
    """With the store down, the front answers 503 + Retry-After (it cannot encode) and a vLLM
    replica asked with vitserve's keys encodes the images itself (the probe failed: a miss),
    giving vLLM alone's answer. With the store back (empty), the front answers again."""
    a = replicas["a"]
    rng = np.random.default_rng(5)
    images = [png(rng, 112, 112), png(rng, 224, 112)]
    alone = answer(post(a.url, body([user(images)])))
    keys = keys_of(vitserve.url, images)
    before = a.counts()
    store.kill()
    try:
        refused = post(vitserve.front, body([user([png(rng, 112, 112)])]))
        assert refused.status_code == 503, refused.text[:300]
        assert "retry-after" in refused.headers
        assert refused.json()["error"]["type"]
        down = answer(post(a.url, body([user(images, uuids=keys)])))
        assert tokens(down) == tokens(alone)
        moved = delta(before, a.counts())
        # the probe failed, or ran past its budget while the SDK tried the service: misses
        assert moved["probe_errors"] + moved["probe_timeouts"] == 2, moved
        assert moved["misses"] == 2 and moved["loads"] == 0, moved
    finally:
        store.start()  # the same port, empty
    for replica in replicas.values():  # both replicas keep serving
        assert httpx.get(f"{replica.url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 60
    while True:  # the service's store client reconnects
        back = post(vitserve.front, body([user(images)]))
        if back.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert tokens(answer(back)) == tokens(alone)


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["corrupt image", "too many images", "unknown model"])
def test_bad_input_through_the_front_is_a_4xx(
    case: str, vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    rng = np.random.default_rng(6)
    if case == "corrupt image":
        payload = body([user([png(rng, 112, 112)[:200]])])
    elif case == "too many images":  # over vLLM's --limit-mm-per-prompt (16)
        payload = body([user([png(rng, 56, 56) for _ in range(17)])])
    else:
        payload = {**body([user([png(rng, 112, 112)])]), "model": "no-such-model"}
    response = post(vitserve.front, payload)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert "error" in response.json()
    for replica in replicas.values():
        assert httpx.get(f"{replica.url}/health", timeout=10).status_code == 200


# -- models, with the official client ----------------------------------------------------------
def test_openai_clients_list_models_on_the_front_and_the_prefill_app(
    vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    import openai

    for base in (f"{vitserve.url}/vllm/v1", f"{vitserve.url}/prefill/v1"):
        client = openai.OpenAI(base_url=base, api_key="unused")
        models = client.models.list()
        assert [m.id for m in models.data] == [SERVED_NAME], base
        reply = client.chat.completions.create(
            model=SERVED_NAME,
            max_tokens=3,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        image_part(png(np.random.default_rng(7), 112, 112)),
                    ],
                }
            ],
        )
        assert reply.choices[0].message.content is not None
