"""API fuzzing from the live applications' OpenAPI documents (schemathesis), over real HTTP
against a deployed vitserve application and a prefill application beside it: thousands of
generated requests, valid by the schema (positive) and not (negative), to every route a client
calls (encode JSON and multipart, probe, rows, the embeddings fetch, healthz, the prefill's chat
completions). None may answer 5xx, every error answer has the API's one shape, and no replica
may crash (the applications' replica actors the same before and after, and still answering).

Cases are generated operation by operation (hypothesis, through schemathesis' strategies) and
sent from a few threads while the next operation's are generated.

The prefill's chat route reads its body itself; its OpenAPI document has no request body, so the
test adds ``ChatRequest``'s JSON schema to it, with ``max_tokens`` capped at 3 to bound the
run's generation time (the application's own ``prefill.max_tokens`` is 2 here).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.fuzz.budget import budget
from vitserve.testing.images import make_image

# Examples per (operation, generation mode) at full budget (tests/fuzz/budget.py: make test
# draws a fifth); hypothesis stops early where a space is exhausted. ~1,250 requests in all at
# full budget (each run draws new cases).
INGRESS = {
    "POST /v1/encode": budget(200),
    "POST /v1/probe": budget(100),
    "POST /v1/rows": budget(100),
    "GET /v1/embeddings/{key}": budget(120),
    "GET /healthz": budget(10),
}
PREFILL = {"POST /v1/chat/completions": budget(100), "GET /healthz": budget(10)}
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
THREADS = 6


@pytest.fixture(scope="module")
def chat(main_app, deploy_prefill) -> Iterator[Any]:
    app = deploy_prefill(
        "fuzz-llm", main_app, **{"prefill.num_cpus": 0.02, "prefill.max_tokens": 2}
    )
    yield app
    deploy_prefill.remove(app.name)


def _generate(operation: Any, mode: schemathesis.GenerationMode, n: int) -> list[Any]:
    cases: list[Any] = []

    @given(operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=n,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def collect(case: Any) -> None:
        cases.append(case)

    collect()
    return cases


def _chat_schema(url: str) -> Any:
    """The prefill application's live OpenAPI document, its chat body's token counts capped
    (a fuzzed answer of thousands of tokens would only cost time)."""
    doc = httpx.get(f"{url}/openapi.json", timeout=30).json()
    route = doc["paths"]["/v1/chat/completions"]["post"]
    body = route["requestBody"]["content"]["application/json"]["schema"]
    capped = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]}
    body["properties"].update(max_tokens=capped, max_completion_tokens=capped)
    return schemathesis.openapi.from_dict(doc)


def _operations(schema: Any) -> dict[str, Any]:
    return {op.label: op for op in (r.ok() for r in schema.get_all_operations())}


def _replicas(*apps: str) -> set[str]:
    """The names of ``apps``' Serve replica actors (a restarted replica gets a new name)."""
    import ray

    prefixes = tuple(f"SERVE_REPLICA::{app}#" for app in apps)
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefixes)
    }


def _shape_problem(response: requests.Response) -> str | None:
    """Why an error answer is not ``{"error": {"type", "message", ...}}`` (None: it is)."""
    try:
        error = response.json()["error"]
        assert isinstance(error["type"], str) and isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return response.text[:200]
    return None


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_and_crash_no_replica(main_app, chat, reliability) -> None:
    ingress = _operations(schemathesis.openapi.from_url(f"{main_app.url}/openapi.json", timeout=30))
    assert set(INGRESS) <= set(ingress), sorted(ingress)  # each route has its schema
    media = {b.media_type for b in ingress["POST /v1/encode"].body}
    assert media == {"application/json", "multipart/form-data"}
    assert ingress["POST /v1/probe"].body and ingress["POST /v1/rows"].body
    prefill = _operations(_chat_schema(chat.url))
    targets = [("encoder", main_app.url, ingress, INGRESS), ("prefill", chat.url, prefill, PREFILL)]
    before = _replicas(main_app.name, chat.name)
    kinds = {name.split("#")[1] for name in before}
    assert kinds >= {"Ingress", "EncoderDeployment", "PrefillServer"}, before

    local = threading.local()

    def send(kind: str, base_url: str, case: Any) -> tuple[str, int, str | None]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        response = case.call(base_url=base_url, session=local.session, timeout=60)
        if response.status_code >= 500:
            return kind, response.status_code, f"{response.text[:200]}\n{case.as_curl_command()}"
        problem = None if response.status_code < 400 else _shape_problem(response)
        return kind, response.status_code, problem

    started = time.monotonic()
    with cf.ThreadPoolExecutor(THREADS) as pool:  # sends while the next cases are generated
        futures = [
            pool.submit(send, f"{app} {label} {mode.value}", url, case)
            for app, url, operations, examples in targets
            for label, n in examples.items()
            for mode in (MODES if label != "GET /healthz" else MODES[:1])
            for case in _generate(operations[label], mode, n)
        ]
        results = [f.result(timeout=120) for f in futures]
    elapsed = time.monotonic() - started

    statuses = Counter((kind, status) for kind, status, _ in results)
    server_errors = [(kind, status, p) for kind, status, p in results if status >= 500]
    assert not server_errors, server_errors[:5]
    misshapen = [(kind, status, p) for kind, status, p in results if p is not None]
    assert not misshapen, misshapen[:5]
    # valid input reached the routes' work, not only the validators
    answered = {kind.rsplit(" ", 1)[0] for (kind, status) in statuses if status == 200}
    assert answered >= {
        "encoder POST /v1/encode",
        "encoder POST /v1/probe",
        "prefill POST /v1/chat/completions",
    }, statuses
    # no replica crashed or restarted, and both applications still answer
    assert _replicas(main_app.name, chat.name) == before
    good = main_app.encode([make_image(48, 40, seed=31337)])
    assert good.status_code == 200 and "num_tokens" in good.json()["items"][0], good.text
    answer = chat.chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert answer.status_code == 200, answer.text

    by_status = sorted(Counter(s for _, s, _ in results).items())
    print(f"\n{len(results)} fuzzed requests in {elapsed:.1f} s; statuses: {by_status}")
    routes = len(INGRESS) + len(PREFILL)
    reliability.record(
        "Bad input: API fuzz from the OpenAPI schemas (schemathesis)",
        tried=len(results),
        failed=len(server_errors),
        wrong=0,
        lost=0,
        note=f"{routes} routes of both applications, valid and invalid by the "
        "schema; 0 replica restarts",
    )
