"""Service fixtures: one Serve instance (HTTP on a free port) in the session's Ray cluster.

Each test module deploys the applications it needs with ``deploy(name, **overrides)``: the real
vitserve application (ingress -> preprocess -> encoder) over the tiny Qwen2-VL model in fp32,
under route prefix ``/<name>`` and store namespace ``t-<name>``. Applications stay up for the
session (a Serve deployment takes seconds to start) and are deleted at its end.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples.append((m[1], dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return samples


@dataclass
class App:
    """One deployed vitserve application and how a test talks to it."""

    name: str
    url: str
    config: Any
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def encoder(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle("EncoderDeployment", app_name=self.name)

    def counters(self) -> dict[str, Any]:
        return self.encoder().counters.remote().result()

    def encode(self, images: list[bytes]) -> httpx.Response:
        files = [("images", (f"{i}.img", b, "application/octet-stream"))
                 for i, b in enumerate(images)]  # fmt: skip
        return self.client.post(f"{self.url}/v1/encode", files=files)

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """This application's samples on the /metrics route."""
        text = self.client.get(f"{self.url}/metrics").text
        return [s for s in parse_metrics(text) if s[1].get("application") == self.name]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of this application's samples of ``name`` that match ``labels``."""
        return sum(
            value
            for n, lab, value in self.samples()
            if n == name and all(lab.get(k) == v for k, v in labels.items())
        )

    def wait_metric(self, name: str, predicate: Callable[[float], bool], timeout: float = 20,
                    **labels: str) -> float:  # fmt: skip
        """Poll /metrics until ``predicate(value)`` holds (Ray reports every second here);
        the last value either way."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, **labels)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.5)


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> Iterator[str]:
    from ray import serve

    from vitserve.deployments.local import free_port, start_serve

    yield start_serve("127.0.0.1", free_port())
    serve.shutdown()


@pytest.fixture(scope="session")
def deploy(serve_url: str, tiny_models: dict[str, Path],
           batching_limits: dict[str, int]) -> Iterator[Callable[..., App]]:  # fmt: skip
    from ray import serve

    from vitserve.deployments.app import build_application
    from vitserve.deployments.config import VitserveConfig
    from vitserve.deployments.local import serve_app

    apps: dict[str, App] = {}

    def _deploy(name: str, **overrides: Any) -> App:
        if name in apps:
            return apps[name]
        # Small CPU shares so several applications fit the session's 2-CPU cluster; batching
        # limits set here, not derived from the host.
        base = {
            "model": str(tiny_models["qwen2_vl"]),
            "dtype": "fp32",
            "budget_bytes": batching_limits["budget_bytes"],
            "batching.max_batch_patches": batching_limits["max_batch_patches"],
            "namespace": f"t-{name}",
            "torch_threads": 1,
            "encoder.num_cpus": 0.2,
            "preprocess.num_cpus": 0.1,
            "ingress.num_cpus": 0.05,
        }
        cfg = VitserveConfig.load({**base, **overrides})  # a section given merges
        serve_app(build_application(cfg), name=name, route_prefix=f"/{name}")
        apps[name] = App(name, f"{serve_url}/{name}", cfg)
        return apps[name]

    yield _deploy
    for name in apps:
        serve.delete(name)


@pytest.fixture(scope="session")
def main_app(deploy: Callable[..., App]) -> App:
    """The application most tests share: batching on (a longer wait, so concurrent requests
    reliably meet), limits small enough to test cheaply."""
    return deploy(
        "main",
        batching={"batch_wait_timeout_s": 0.2},
        limits={"max_images_per_request": 8, "max_request_bytes": 3 * 2**20,
                "max_image_bytes": 2 * 2**20, "max_image_pixels": 4_000_000},
    )  # fmt: skip
