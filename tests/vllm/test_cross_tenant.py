"""Tenant isolation through the vLLM front, with a real vLLM behind it (issue 28): zero cache hits
and zero reads across tenants.

A second ``vitserve serve`` with auth on (tenants alice and bob) and its vLLM front before the
session's replica A (its own tower; see conftest.py), over the session's Redis. Alice asks about
a new image through the front. Then bob:

* sends the same image: vitserve encodes it again, in bob's namespace (``x-vitserve-uploaded``
  1, ``x-vitserve-cached`` 0), and he gets vLLM alone's answer for it (the control);
* names alice's image by her key, which he knows, as the ``uuid`` of an image part the front
  does not encode (no image at all, a ``DATA:`` URL of his own image, an ``input_image``
  part): vLLM keys its multimodal processor cache and encoder cache by that ``uuid``, so what
  bob gets must be what a key never stored gets, never an answer about alice's image.

The companion checks without vLLM (every other route, and what the front forwards to a fake
vLLM) are ``tests/reliability/test_cross_tenant.py``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from vitserve.keys import content_key

from .chat import (
    LOGPROB_TOL,
    TIMEOUT,
    answer,
    body,
    delta,
    logprob_gap,
    png,
    post,
    tokens,
    user,
)
from .conftest import Replica, vitserve_serve

ALICE = "xtv-alice-token-0123456789abcdef"
BOB = "xtv-bob-token-fedcba9876543210xy"
TOKENS = [{"tenant": "alice", "token": ALICE}, {"tenant": "bob", "token": BOB}]


@dataclass
class Front:
    """The authenticated service's vLLM front, and how its tenants key images."""

    url: str
    fingerprint: str
    namespace: dict[str, str]

    def chat(self, payload: dict[str, Any], token: str) -> httpx.Response:
        return httpx.post(
            f"{self.url}/vllm/v1/chat/completions",
            json=payload,
            headers={"Authorization": f"Bearer {token}"},
            timeout=TIMEOUT,
        )

    def key(self, image: bytes, tenant: str) -> str:
        return content_key(image, self.fingerprint, self.namespace[tenant])


@pytest.fixture(scope="module")
def front(
    model_dir: Path,
    store: Any,
    replicas: dict[str, Replica],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Front]:
    """``vitserve serve`` with two tenants and the vLLM front before replica A alone (so that
    every request of the module meets the same vLLM caches)."""
    from vitserve.deployments.runner.local import free_port

    extra = (
        "--vllm-url",
        replicas["a"].url,
        "--set",
        f"auth.tokens={json.dumps(TOKENS)}",
        "--set",
        "namespace=xtv",
    )
    log = tmp_path_factory.mktemp("vitserve-auth") / "serve.log"
    with vitserve_serve(model_dir, store.url, free_port(), log, extra) as service:
        health = {
            name: httpx.get(
                f"{service.url}/healthz", headers={"Authorization": f"Bearer {token}"}, timeout=30
            ).json()
            for name, token in (("alice", ALICE), ("bob", BOB))
        }
        yield Front(
            service.url,
            health["alice"]["fingerprint"],
            {name: h["namespace"] for name, h in health.items()},
        )


def _counts(response: httpx.Response) -> tuple[int, int]:
    return int(response.headers["x-vitserve-uploaded"]), int(response.headers["x-vitserve-cached"])


def test_a_tenants_image_sent_by_another_is_encoded_again_in_its_namespace(
    front: Front, replicas: dict[str, Replica], reliability
) -> None:
    """Alice's new image through the front, then bob's same image: each tenant's copy is
    uploaded and encoded (no cache hit across tenants), and both get vLLM alone's answer."""
    rng = np.random.default_rng(2801)
    image = png(rng, 224, 224)
    alone = answer(post(replicas["a"].url, body([user([image])])))
    before = replicas["a"].counts()
    first = front.chat(body([user([image])]), ALICE)
    second = front.chat(body([user([image])]), BOB)
    again = front.chat(body([user([image])]), BOB)
    # each tenant's image is a hit in vLLM, read from the tenant's own namespace (the front
    # names it <namespace>/<key>), though the connector's token is no tenant's
    moved = delta(before, replicas["a"].counts())
    assert moved["hits"] >= 2 and moved["loads"] >= 2, moved
    assert moved["mismatches"] == 0 and moved["probe_errors"] == 0, moved
    assert _counts(first) == (1, 0), first.headers
    assert _counts(second) == (1, 0), second.headers  # bob's own entry: no hit of alice's
    assert _counts(again) == (0, 1), again.headers  # then bob's own, held
    for response in (first, second, again):
        doc = answer(response)
        assert tokens(doc) == tokens(alone)
        assert logprob_gap(doc, alone) < LOGPROB_TOL
    assert front.key(image, "alice") != front.key(image, "bob")
    reliability.record(
        "Cross-tenant vLLM front, real vLLM: B sends A's image",
        tried=3,
        failed=0,
        wrong=0,
        lost=0,
        note="encoded again in B's namespace; vLLM alone's answer",
    )


def _named(image: bytes, key: str) -> dict[str, dict[str, Any]]:
    """Image parts the front does not encode, each naming ``key`` as its ``uuid``."""
    data = base64.b64encode(image).decode()
    return {
        "uuid only (no image)": {"type": "image_url", "image_url": None, "uuid": key},
        "DATA: URL of bob's own image": {
            "type": "image_url",
            "image_url": {"url": f"DATA:image/png;base64,{data}"},
            "uuid": key,
        },
        "input_image part of bob's own image": {
            "type": "input_image",
            "image_url": f"data:image/png;base64,{data}",
            "uuid": key,
        },
    }


def _message(part: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": [part, {"type": "text", "text": "Describe this image."}]}


def test_naming_another_tenants_key_through_the_front_never_reaches_its_image(
    front: Front, replicas: dict[str, Replica], reliability
) -> None:
    """Alice asks about a new image; bob names it by alice's key in parts the front does not
    encode. Each answer must be what a key never stored gets (same status, no completion
    about alice's image): bob's own image, where he sent one, is answered as itself."""
    rng = np.random.default_rng(2802)
    image, own = png(rng, 224, 224), png(rng, 224, 224)
    alices = answer(front.chat(body([user([image])]), ALICE))
    bobs = answer(post(replicas["a"].url, body([user([own])])))  # his image, vLLM alone
    assert tokens(bobs) != tokens(alices)  # the two images are told apart
    key = front.key(image, "alice")
    seen: dict[str, Any] = {}
    for case, part in _named(own, key).items():
        never = content_key(png(rng, 224, 224), front.fingerprint, front.namespace["alice"])
        got = front.chat(body([_message(part)]), BOB)
        ref = front.chat(body([_message({**part, "uuid": never})]), BOB)
        alices_answer = got.status_code == 200 and (
            tokens(got.json()) == tokens(alices) or logprob_gap(got.json(), alices) < LOGPROB_TOL
        )
        seen[case] = {
            "status": got.status_code,
            "never stored": ref.status_code,
            "alice's answer": alices_answer,
            "answer": got.text[:160],
            "never stored answer": ref.text[:160],
        }
    print(json.dumps(seen, indent=1))
    leaks = {
        case: s
        for case, s in seen.items()
        if s["alice's answer"] or s["status"] != s["never stored"]
    }
    assert not leaks, leaks
    reliability.record(
        "Cross-tenant vLLM front (real vLLM): B naming A's key as a part's uuid",
        tried=2 * len(seen),
        failed=sum(s["status"] >= 500 for s in seen.values()),
        wrong=0,
        lost=0,
        note="each answered as a key never stored: refused 422 or B's own image",
    )
