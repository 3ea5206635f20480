"""vitserve across the nodes of a real multi-node Ray cluster (this folder's conftest: a head, two
encoder nodes, a prefill node; every node its own raylet and object store).

The store a multi-node deployment runs on is a tiered one: each node's store actor in front of a
shared Redis Cluster (``tiered://?l1=node://&l2=redis+cluster://...``): reads hit the reader's
node first, claims and lookups that decide go to the shared tier. Shown here:

* **Stores across nodes** (store actors pinned to nodes): a record published on one node is read
  on another, right; with a named ``node://`` actor the read crosses by Ray's object transfer;
  the same new key claimed on two nodes at once is won once. A per-node ``node://`` store, the
  single-node default, finds nothing published on another node: the application's parts check
  where their claims live and refuse to run split (``StoreSplitError``), never stalling.
* **Applications across nodes**: the same new image sent to encoders on two nodes at once is
  encoded once; the prefill application on a third node answers what the monolithic model
  answers; a worker node removed under load: Serve places its replica on a new node, every
  answer right, the failed requests counted.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.conftest import App
from tests.multinode.conftest import MultiNode
from tests.reliability.faults import Load, check_answers, fresh_image, replicas
from vitserve.cache.codec import encode_record
from vitserve.cache.urls import tiered_url
from vitserve.testing.records import make_record


@pytest.fixture(scope="module")
def shared_url(redis_cluster_url: str) -> str:
    return tiered_url("node://", redis_cluster_url)


def _store_actor_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class StoreOnNode:
        """A store opened in a process on one node (``resources`` place it), as a replica
        there opens it."""

        def __init__(self, url: str, namespace: str) -> None:
            from vitserve.cache import open_store

            self.store = open_store(url, namespace=namespace)

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def claim_scope(self) -> str | None:
            return self.store.connection.claim_scope

        def lookup_or_claim(self, keys: list[str]) -> list[str]:
            return [getattr(a, "value", "held") for a in self.store.lookup_or_claim(keys, 30.0)]

        def publish(self, key: str, value: bytes) -> None:
            self.store.put_values([(key, value)], release=[(key, self.store.token)])

        def rows(self, key: str, r0: int, r1: int) -> np.ndarray | None:
            record = self.store.get_rows(key, r0, r1)
            return None if record is None else np.array(record.embedding)

        def wait_for(self, key: str, timeout_s: float) -> bool:
            return self.store.wait_for(key, timeout_s)

    return StoreOnNode


@pytest.fixture
def on_node(multinode: MultiNode) -> Iterator[Callable[[str, str, str], Any]]:
    """``on_node(node, url, namespace)``: a StoreOnNode actor on that node."""
    import ray

    actors: list[Any] = []
    cls = _store_actor_class()

    def make(node: str, url: str, namespace: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(multinode.node_id(node), soft=False)
        actors.append(cls.options(scheduling_strategy=strategy).remote(url, namespace))
        return actors[-1]

    yield make
    for actor in actors:
        ray.kill(actor)


# -- stores across nodes -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["tiered", "named node actor"])
def test_a_record_published_on_one_node_is_read_on_another(
    kind: str, on_node, shared_url: str, multinode: MultiNode
) -> None:
    import ray

    url = (
        shared_url if kind == "tiered" else f"node://?actor_name=vitserve-mn-{uuid.uuid4().hex[:6]}"
    )
    ns = uuid.uuid4().hex[:8]
    writer, reader = on_node("encoder_a", url, ns), on_node("prefill", url, ns)
    assert ray.get(writer.node.remote()) != ray.get(reader.node.remote())
    record = make_record(rows=300, width=64, dtype="fp16", seed=7)
    assert ray.get(writer.lookup_or_claim.remote([record.key])) == ["won"]
    ray.get(writer.publish.remote(record.key, bytes(encode_record(record))))
    rows = ray.get(reader.rows.remote(record.key, 100, 250))
    assert rows is not None and np.array_equal(rows, record.embedding[100:250])


def test_a_per_node_store_finds_nothing_published_on_another_node(
    on_node, multinode: MultiNode
) -> None:
    """``node://`` alone is each node's: what one node publishes another does not find, and
    their claim scopes say so (what the application's parts compare)."""
    import ray

    ns = uuid.uuid4().hex[:8]
    writer, reader = on_node("encoder_a", "node://", ns), on_node("encoder_b", "node://", ns)
    assert ray.get(writer.claim_scope.remote()) != ray.get(reader.claim_scope.remote())
    record = make_record(rows=8, width=16, seed=8)
    ray.get(writer.publish.remote(record.key, bytes(encode_record(record))))
    assert ray.get(reader.rows.remote(record.key, 0, 4)) is None


def test_one_new_key_claimed_on_two_nodes_at_once_is_won_once(on_node, shared_url: str) -> None:
    """Twenty new keys, each asked by an actor on each encoder node at the same moment: one
    wins, the other waits and sees the winner's publish."""
    import ray

    ns = uuid.uuid4().hex[:8]
    a, b = on_node("encoder_a", shared_url, ns), on_node("encoder_b", shared_url, ns)
    for seed in range(20):
        record = make_record(rows=4, width=16, seed=100 + seed)
        got = ray.get(
            [a.lookup_or_claim.remote([record.key]), b.lookup_or_claim.remote([record.key])]
        )
        assert sorted(x for [x] in got) == ["busy", "won"], got
        winner, loser = (a, b) if got[0] == ["won"] else (b, a)
        waiting = loser.wait_for.remote(record.key, 20.0)
        ray.get(winner.publish.remote(record.key, bytes(encode_record(record))))
        assert ray.get(waiting) is True


# -- applications across nodes ------------------------------------------------------------------
def _on(app_name: str, deployment: str) -> list[str]:
    """The node ids of a deployment's live replicas."""
    import ray

    nodes = []
    for _, handle in replicas(app_name, deployment):
        nodes.append(
            ray.get(
                handle.__ray_call__.remote(
                    lambda self: __import__("ray").get_runtime_context().get_node_id()
                )
            )
        )
    return nodes


def test_a_node_local_store_split_across_nodes_is_refused_at_once(deploy) -> None:
    """The ingress on the head, its encoder on another node, both on ``node://`` (the
    single-node default): every encode is refused at once with the split named, instead of
    encoding twice and stalling readers on claims nobody releases."""
    from vitserve.client import EncoderClient
    from vitserve.errors import StoreSplitError

    app = deploy("mn-split", **{"encoder.resources": {"encoder_a": 1}})
    try:
        with EncoderClient(app.url, timeout_s=30) as client:
            started = time.monotonic()
            with pytest.raises(StoreSplitError, match="split"):
                client.encode([fresh_image()])
            assert time.monotonic() - started < 10
    finally:
        deploy.remove(app.name)


def test_the_same_new_image_sent_to_encoders_on_two_nodes_at_once_is_encoded_once(
    deploy, shared_url: str, multinode: MultiNode
) -> None:
    """Two applications on one shared store and namespace, one with its encoder on each encoder
    node; each new image sent to both at the same moment is encoded once, and both answer it."""
    from vitserve.client import EncoderClient

    # a namespace of this run's: the suite's Redis Cluster may outlive a run (.ci/run's)
    common = {"store": shared_url, "namespace": f"mn-shared-{uuid.uuid4().hex[:8]}"}
    apps = [
        deploy(f"mn-{n[-1]}", **common, **{"encoder.resources": {n: 1}})
        for n in ("encoder_a", "encoder_b")
    ]
    try:
        assert [_on(a.name, "EncoderDeployment") for a in apps] == [
            [multinode.node_id("encoder_a")],
            [multinode.node_id("encoder_b")],
        ]
        images = [fresh_image() for _ in range(10)]
        before = [a.client.get(f"{a.url}/v1/stats").json()["encoder"]["images"] for a in apps]
        clients = [EncoderClient(a.url, timeout_s=60) for a in apps]
        with cf.ThreadPoolExecutor(2) as pool:
            for image in images:
                start = threading.Barrier(2)

                def send(
                    client: Any, image: bytes = image, start: threading.Barrier = start
                ) -> Any:
                    start.wait()
                    [handle] = client.encode([image])
                    return handle

                a, b = pool.map(send, clients)
                assert a.key == b.key
        for client in clients:
            client.close()
        after = [a.client.get(f"{a.url}/v1/stats").json()["encoder"]["images"] for a in apps]
        encoded = [x - y for x, y in zip(after, before, strict=True)]
        assert sum(encoded) == len(images), encoded  # each once, by one node or the other
    finally:
        for app in apps:
            deploy.remove(app.name)


@pytest.fixture(scope="module")
def spread_app(deploy, shared_url: str) -> Iterator[App]:
    """The encoder application with a replica on each encoder node (``encoder: 1`` each), its
    ingress on the head, on the shared tiered store."""
    app = deploy(
        "mn-spread",
        store=shared_url,
        namespace=f"mn-spread-{uuid.uuid4().hex[:8]}",
        batching={"batch_wait_timeout_s": 0.02},
        **{"encoder.num_replicas": 2, "encoder.resources": {"encoder": 1}},
    )
    yield app
    deploy.remove(app.name)


def test_the_prefill_on_a_third_node_answers_what_the_monolithic_model_answers(
    spread_app: App, deploy_prefill, tiny_models, multinode: MultiNode
) -> None:
    """Encoder replicas on the two encoder nodes, the prefill application on the prefill node
    reading rows through its node's tier from the shared one: greedy tokens and each token's
    top logprobs over HTTP equal the full transformers model's on the pixels."""
    import torch
    from transformers import AutoTokenizer

    from tests.deployments.test_prefill import (
        LOGIT_ATOL,
        NEW_TOKENS,
        TOP,
        _full_model,
        _images,
        chat_body,
        reference_inputs,
    )

    path = tiny_models["qwen2_vl"]
    model = _full_model(path, "qwen2_vl")
    inputs = reference_inputs(path, "qwen2_vl", model.config)
    with torch.no_grad():
        gen = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    want = gen.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    prefill = deploy_prefill("mn-prefill", spread_app, **{"prefill.resources": {"prefill_node": 1}})
    try:
        assert sorted(_on(spread_app.name, "EncoderDeployment")) == sorted(
            multinode.node_id(n) for n in ("encoder_a", "encoder_b")
        )
        assert _on(prefill.name, "PrefillServer") == [multinode.node_id("prefill")]
        response = prefill.chat(chat_body(_images(), logprobs=True, top_logprobs=TOP))
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["logprobs"]["content"]
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert [c["token"] for c in content] == tokenizer.convert_ids_to_tokens(want)
        worst = 0.0
        for entry, logits in zip(content, [s[0] for s in gen.logits], strict=False):
            values, ids = torch.log_softmax(logits.float(), -1).topk(TOP)
            got = entry["top_logprobs"]
            assert [t["token"] for t in got] == tokenizer.convert_ids_to_tokens(ids.tolist())
            worst = max(
                worst, *(abs(t["logprob"] - float(v)) for t, v in zip(got, values, strict=True))
            )
        assert worst <= LOGIT_ATOL
    finally:
        deploy_prefill.remove(prefill.name)


def test_a_worker_node_removed_under_load(
    spread_app: App, multinode: MultiNode, engines, reliability
) -> None:
    """Three SDK clients on the spread application; the node of one encoder replica removed (no
    drain). The other replica serves meanwhile; a new node with the encoder resource joins (as
    an autoscaler would add one) and Serve places the lost replica there. Every answer is the
    in-process engine's; nothing answered is lost (the removed node's tier held copies of what
    the shared tier holds); the failed requests are counted."""
    load = Load(spread_app.url, threads=3).start()
    try:
        warm = load.wait(lambda: load.repeats_answered() and len(load.answers) >= 6, 120)
        assert warm, load.failures[:3]
        lost_node = multinode.node_id("encoder_a")
        multinode.remove_node("encoder_a")
        removed_at = time.monotonic()
        served_meanwhile = load.wait(lambda: load.answered_since(removed_at + 1.0) >= 3, 60)
        multinode.add_node("encoder_a", {"encoder": 1, "encoder_a": 1})  # the replacement
        new_node = multinode.node_id("encoder_a")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and new_node not in _on(
            spread_app.name, "EncoderDeployment"
        ):
            time.sleep(0.5)
        replaced_at = time.monotonic()
        nodes = _on(spread_app.name, "EncoderDeployment")
        answered = load.wait(lambda: load.answered_since(replaced_at) >= 6, 60)
    finally:
        unanswered = load.stop()
    wrong, differing = check_answers(load.answers, engines["qwen2_vl"])
    from tests.reliability.test_faults import missing_at_the_end

    gone = missing_at_the_end(spread_app, {a.key for a in load.answers})
    assert served_meanwhile and answered
    assert new_node in nodes and lost_node not in nodes, (nodes, new_node, lost_node)
    assert unanswered == 0
    assert wrong == [] and differing == []
    assert gone == []
    reliability.record(
        "Ray worker node removed under load (encoder replica on it; 2 encoder nodes)",
        tried=load.tried,
        failed=len(load.failures),
        wrong=len(wrong) + len(differing),
        lost=unanswered + len(gone),
        note=f"3 SDK clients, default retries ({load.retries} made); replica on a new node "
        f"{replaced_at - removed_at:.0f} s after the removal",
    )


def test_a_named_node_store_whose_node_leaves_comes_back_empty(
    on_node, multinode: MultiNode
) -> None:
    """A ``node://`` store actor shared by name lives on the node of its first opener; that node
    removed, its actor and objects are gone: a reader elsewhere gets a retryable error, then the
    store re-made empty (on the reader's node), so what it held is encoded again when next
    asked for, never read wrong."""
    import ray

    from vitserve.errors import StoreUnavailableError

    multinode.add_node("spare", {"spare": 1})
    url = f"node://?actor_name=vitserve-mn-{uuid.uuid4().hex[:6]}&timeout_s=5"
    ns = uuid.uuid4().hex[:8]
    owner = on_node("spare", url, ns)
    assert ray.get(owner.node.remote()) == multinode.node_id("spare")  # it opened first
    reader = on_node("prefill", url, ns)
    record = make_record(rows=16, width=16, seed=9)
    ray.get(owner.publish.remote(record.key, bytes(encode_record(record))))
    assert ray.get(reader.rows.remote(record.key, 0, 16)) is not None
    gone = multinode.node_id("spare")
    multinode.remove_node("spare")
    deadline = time.monotonic() + 60
    while any(n["NodeID"] == gone and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the removed node never left"
        time.sleep(0.2)
    outcomes = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            outcomes.append(ray.get(reader.lookup_or_claim.remote([record.key]), timeout=30))
            break
        except ray.exceptions.RayTaskError as exc:
            assert isinstance(exc.cause, StoreUnavailableError), exc
            outcomes.append("unavailable")
    assert outcomes[-1] == ["won"], outcomes  # a miss: claimed, to be encoded again
