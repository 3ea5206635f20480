"""A way in without the front (issue 40): vLLM replicas whose connector has role ``ec_both``
publish what their own tower encodes into vitserve's store, under vLLM's own identifier, and
the others then hit instead of encoding again. Real vLLM servers, real Redis (conftest.py).

Replicas D and E: the session's checkpoint (``check_model: weights``, required to publish), each
on one core, no front: clients send plain OpenAI chats, no ``uuid`` s. (``ec_both`` with
``tower-may-differ`` refused at start: ``test_vouch.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from loadtest.vllm_peer import VllmServer

from .chat import LOGPROB_TOL, answer, body, delta, logprob_gap, png, post, tokens, user
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    Replica,
    Vitserve,
    ec_config,
    side_by_side,
    vllm_python,
)


@pytest.fixture(scope="module")
def both(
    vitserve: Vitserve, model_dir: Any, store: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Replica]]:
    from vitserve.deployments.runner.local import free_port

    logs = tmp_path_factory.mktemp("vllm-both")
    servers = {
        name: VllmServer(
            vllm_python(),
            str(model_dir),
            free_port(),
            dtype="float32",
            log_path=str(logs / f"{name}.log"),
            served_model_name=SERVED_NAME,
            ready_timeout=300,
            extra_env={"VLLM_CPU_OMP_THREADS_BIND": core, **ONE_PROCESS_ENV},
            extra_args=[
                "--ec-transfer-config",
                ec_config(vitserve.url, store.url, "ec_both"),
                *ONE_PROCESS_ARGS,
            ],
        )
        for name, core in (("d", "0"), ("e", "1"))
    }
    with side_by_side(*servers.values()):
        yield {name: Replica(name, server) for name, server in servers.items()}


def test_an_image_vllm_encoded_on_one_replica_is_a_hit_on_the_other(
    vitserve: Vitserve, both: dict[str, Replica]
) -> None:
    """The same new image to D, then to E: D encodes it with its own tower and publishes it
    (claimed at its probe, the claim released by the publish); E loads it from the store, its
    tower idle; vitserve's encoder never runs; E's answer is D's (vLLM alone's: its own
    tower)."""
    d, e = both["d"], both["e"]
    rng = np.random.default_rng(4003)
    images = [png(rng, 224, 224)]
    encoded = vitserve.encoded()
    before = {name: r.counts() for name, r in both.items()}
    first = answer(post(d.url, body([user(images)])))
    moved_d = delta(before["d"], d.counts())
    assert moved_d["misses"] == 1 and moved_d["saves"] == 1, moved_d
    assert moved_d["save_failures"] == 0 and moved_d["loads"] == 0, moved_d

    other = answer(post(e.url, body([user(images)])))
    moved_e = delta(before["e"], e.counts())
    assert moved_e["hits"] == 1 and moved_e["loads"] == 1 and moved_e["misses"] == 0, moved_e
    assert moved_e.get("saves", 0) == 0, moved_e
    assert tokens(other) == tokens(first)
    gap = logprob_gap(other, first)
    print(f"E from D's published rows: max |prompt logprob difference| {gap:.2g}")
    assert gap < LOGPROB_TOL, gap
    assert vitserve.encoded() == encoded  # vitserve's encoder never ran
