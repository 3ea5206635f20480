"""A real multi-node Ray cluster on this machine for tests/multinode: ``ray.cluster_utils.Cluster``
with a head and three worker nodes, each its own raylet and object store, custom resources to
place replicas:

* head: 2 CPUs: Serve's controller and its one HTTP proxy (``HeadOnly``: every node shares this
  machine's address, so a proxy per node could not take the port), the ingresses;
* ``encoder-a`` and ``encoder-b``: 1 CPU each, resources ``encoder`` (any encoder replica) and
  ``encoder_a`` / ``encoder_b`` (that node's);
* ``prefill``: 1 CPU, resource ``prefill_node``.

Collected only with ``VITSERVE_TEST_MULTINODE=1`` (``make test-multinode``), in a pytest process
of its own: one process drives one Ray cluster, and the suite's is a single node. The suite's
fixtures (``deploy``, ``deploy_prefill``, ...) run on this cluster here: ``ray_cluster`` and
``serve_url`` are this folder's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

OBJECT_STORE_BYTES = 150 * 2**20  # each node's: four of them on this machine
ENCODER_NODES = ("encoder_a", "encoder_b")


@dataclass
class MultiNode:
    """The running cluster: ``nodes`` by name (``ray.cluster_utils`` node handles) and their Ray
    node ids; ``add_encoder_node`` stands in for an autoscaler replacing a lost node."""

    cluster: Any
    nodes: dict[str, Any] = field(default_factory=dict)

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def add_node(self, name: str, resources: dict[str, float]) -> Any:
        self.nodes[name] = self.cluster.add_node(
            num_cpus=1, resources=resources, object_store_memory=OBJECT_STORE_BYTES
        )
        self.cluster.wait_for_nodes()
        return self.nodes[name]

    def remove_node(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@pytest.fixture(scope="session")
def multinode() -> Iterator[MultiNode]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    from vitserve.deployments.runner.local import LOCAL_SYSTEM_CONFIG

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 1000, **LOCAL_SYSTEM_CONFIG},
        },
    )
    nodes = MultiNode(cluster)
    for name in ENCODER_NODES:
        nodes.add_node(name, {"encoder": 1, name: 1})
    nodes.add_node("prefill", {"prefill_node": 1})
    ray.init(address=cluster.address, namespace="vitserve-tests", logging_level="warning")
    yield nodes
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(multinode: MultiNode) -> Any:
    """The suite's ``ray_cluster``, as this folder's multi-node cluster."""
    import ray

    return ray


@pytest.fixture(scope="session")
def serve_url(ray_cluster: Any) -> Iterator[str]:
    """Serve on the head only (one proxy: every node has this machine's address)."""
    from ray import serve

    from vitserve.deployments.runner.local import free_port

    port = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"},
        logging_config={"enable_access_log": False},
    )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
