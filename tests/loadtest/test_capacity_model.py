"""The capacity model's arithmetic, and that it reads the committed results pages it cites."""

from __future__ import annotations

import dataclasses

import pytest

from loadtest.capacity_model import (
    Deployment,
    Measured,
    StoreCosts,
    project,
    read_pages,
    store_throughput,
)

MEASURED = Measured(
    store_op_ms=0.03,
    store_kib_ms=0.0003,
    proxy_ms=5.0,
    controller_base_ms_s=35.0,
    controller_replica_ms_s=0.1,
    encoder_patches_s=40_000.0,
    gpu="test",
)


def test_store_throughput_is_the_smallest_of_its_resources() -> None:
    costs = StoreCosts(server_ms=1.0, client_ms=3.0)
    # 2 cores bind: 2 / 4 ms
    assert store_throughput(costs, shards=3, clients=8, cores=2) == pytest.approx(500.0)
    # one primary binds once the host has cores to spare: 1 / 1 ms
    assert store_throughput(costs, shards=1, clients=8, cores=64) == pytest.approx(1000.0)
    assert store_throughput(costs, shards=3, clients=8, cores=64) == pytest.approx(8 / 3e-3)


def test_loads_scale_with_gpus_and_the_first_bottleneck_moves() -> None:
    d = Deployment()
    ten, thousand = project(MEASURED, d, 10), project(MEASURED, d, 1000)
    assert thousand.new_per_s == pytest.approx(100 * ten.new_per_s)
    assert thousand.requests_per_s == pytest.approx(thousand.new_per_s / (1 - d.hit_rate))
    assert thousand.store_out_gbs == pytest.approx(2 * thousand.store_in_gbs)  # reads per request
    assert thousand.shards_needed > ten.shards_needed
    # the controller grows with replicas; more primaries deployed relieve the store only
    big = dataclasses.replace(d, shards_deployed=10_000)
    assert project(MEASURED, big, 1000).store < thousand.store
    assert project(MEASURED, big, 1000).controller == thousand.controller
    assert project(MEASURED, big, 1000).first_bottleneck()[0] != thousand.first_bottleneck()[0]


def test_the_committed_pages_read() -> None:
    m = read_pages()
    assert m.store_op_ms > 0 and m.store_kib_ms > 0 and m.proxy_ms > 0
    assert m.encoder_patches_s > 1000 and "H100" in m.gpu
