"""Session-wide fixtures: offline mode, the tiny random-weight models of every family, Redis,
one Ray cluster and the service fixtures (below) that the deployment and client tests share."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.redis_process import RedisServer

# tests/vllm runs against real vLLM servers from vLLM's own venv: `make test-vllm` runs it (and
# sets VITSERVE_TEST_VLLM=1); `make test` leaves it out.
collect_ignore = [] if os.environ.get("VITSERVE_TEST_VLLM") == "1" else ["vllm"]

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a tiny random-weight full VLM saved with save_pretrained."""
    from vitserve.encoder.testmodels import FAMILIES, make_model

    root = tmp_path_factory.mktemp("models")
    return {family: make_model(family, "tiny", root / family) for family in FAMILIES}


# Batching limits the suite's engines and services set themselves, so no test's batching
# depends on the host (the CPU cap follows its last-level cache, the default budget its free
# memory): room for the largest request the tests send to the tiny models in one forward.
TEST_MAX_BATCH_PATCHES = 8192
TEST_BUDGET_BYTES = 2**30


def _engines(tiny_models: dict[str, Path], dtype: str, limits: dict[str, int]) -> dict:
    from vitserve.encoder.engine import EncoderEngine

    return {
        f: EncoderEngine.from_pretrained(str(p), device="cpu", dtype=dtype, **limits)
        for f, p in tiny_models.items()
    }


@pytest.fixture(scope="session")
def batching_limits() -> dict[str, int]:
    """The batching limits every engine and service of the suite sets (see above)."""
    return {"max_batch_patches": TEST_MAX_BATCH_PATCHES, "budget_bytes": TEST_BUDGET_BYTES}


@pytest.fixture(scope="session")
def engines(tiny_models: dict[str, Path], batching_limits: dict[str, int]):
    """family -> fp32 CPU EncoderEngine over the tiny model (shared; read counters as deltas)."""
    return _engines(tiny_models, "fp32", batching_limits)


@pytest.fixture(scope="session")
def bf16_engines(tiny_models: dict[str, Path], batching_limits: dict[str, int]):
    """family -> bf16 CPU EncoderEngine (the default dtype of CPUs with native bf16 and of
    GPUs; emulated, and slower, elsewhere: the tiny models keep it cheap)."""
    return _engines(tiny_models, "bf16", batching_limits)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (starting one takes 5-8 s)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if not ray.is_initialized():
        # address="local": a new cluster of this session, never one left running on the
        # machine (ray.init() alone would join a `ray start` cluster). Metrics reach the
        # node's endpoint every second (default 10 s), so tests of /metrics wait briefly.
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 namespace="vitserve-tests",
                 logging_level="warning",
                 _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The suite's Redis (127.0.0.1:6379, db 15, which the suite may flush)."""
    import redis

    url = os.environ.get("VITSERVE_TEST_REDIS", "redis://127.0.0.1:6379/15")
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"the test suite needs a Redis at {url} (.ci/run starts one): {exc}")
    client.flushdb()
    client.close()
    return url


@pytest.fixture
def spawn_redis() -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def spawn(*args: str) -> RedisServer:
        servers.append(RedisServer(*args))
        return servers[-1]

    yield spawn
    for server in servers:
        server.kill()


@pytest.fixture(scope="session")
def lru_redis_url() -> Iterator[str]:
    """A private redis-server whose maxmemory the LRU test sets (allkeys-lru)."""
    server = RedisServer("--maxmemory-policy", "allkeys-lru")
    yield server.url
    server.kill()


# -- service fixtures ----------------------------------------------------------------------------
# One Serve instance (HTTP on a free port) in the session's Ray cluster.
#
# Each test module deploys the applications it needs with ``deploy(name, **overrides)`` (and
# removes those no other module uses with ``deploy.remove(name)``): the real
# vitserve application (ingress -> preprocess -> encoder) over the tiny Qwen2-VL model in fp32,
# under route prefix ``/<name>`` and store namespace ``t-<name>``. Applications stay up for the
# session (a Serve deployment takes seconds to start) and are deleted at its end.

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

    def page(self) -> Callable[..., float]:
        """One fetch of /metrics: ``value(name, **labels)``, the sum of this application's
        samples of ``name`` that match ``labels`` (a page is ~2 MB late in the suite: Ray keeps
        the series of every application it served, so read several values from one)."""
        samples = self.samples()

        def value(name: str, **labels: str) -> float:
            wanted = labels.items()
            return sum(v for n, lab, v in samples
                       if n == name and all(lab.get(k) == w for k, w in wanted))  # fmt: skip

        return value

    def metric(self, name: str, **labels: str) -> float:
        """The sum of this application's samples of ``name`` that match ``labels``."""
        return self.page()(name, **labels)

    def wait_page(self, predicate: Callable[[Callable[..., float]], bool],
                  timeout: float = 20) -> Callable[..., float]:  # fmt: skip
        """Poll /metrics until ``predicate(page)`` holds (Ray reports every second here); the
        last page either way."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.page()
            if predicate(page) or time.monotonic() > deadline:
                return page
            time.sleep(0.5)

    def wait_metric(self, name: str, predicate: Callable[[float], bool], timeout: float = 20,
                    **labels: str) -> float:  # fmt: skip
        """``wait_page`` for one value; the last value either way."""
        return self.wait_page(lambda page: predicate(page(name, **labels)), timeout)(name, **labels)


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> Iterator[str]:
    from ray import serve

    from vitserve.deployments.local import free_port, start_serve

    yield start_serve("127.0.0.1", free_port())
    serve.shutdown()


# The applications the running test module deployed, as (registry, name): deleted when the
# module ends (``_remove_module_apps``), so that a module never finds the session cluster's 2 CPUs
# taken by the applications of the modules before it. ``keep=True`` exempts the session's
# shared applications (``main_app``).
_MODULE_APPS: list[tuple[dict[str, Any], str]] = []


def _delete_apps(names: list[str], timeout: float = 120) -> None:
    """Delete the applications ``names`` together and return once Serve has removed them (one
    by one, each ``serve.delete`` waits ~3 s for its replicas to stop)."""
    if not names:  # nothing to ask Serve (a module of unit tests may never have started it)
        return
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout
    while left := set(names) & set(serve.status().applications):
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not deleted after {timeout} s: {sorted(left)}")
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def _remove_module_apps() -> Iterator[None]:
    start = len(_MODULE_APPS)
    yield
    _delete_apps([name for registry, name in _MODULE_APPS[start:]
                  if registry.pop(name, None) is not None])  # fmt: skip
    del _MODULE_APPS[start:]


def _cpus(section: Any) -> float:
    """The CPUs one deployment's replicas reserve (at least one replica)."""
    replicas = section.autoscaling.min_replicas if section.autoscaling else section.num_replicas
    return section.num_cpus * max(replicas, 1)


def _wait_for_cpus(name: str, needed: float, timeout: float = 30) -> None:
    """Fail at once, naming the applications up, when ``name``'s replicas cannot be placed:
    Serve would otherwise wait for the CPUs forever. (A deleted application's CPUs come back
    a moment after ``serve.delete``: wait ``timeout`` for them first.)"""
    import ray
    from ray import serve

    deadline = time.monotonic() + timeout
    while (free := ray.available_resources().get("CPU", 0.0)) + 1e-6 < needed:
        if time.monotonic() > deadline:
            up = sorted(serve.status().applications)
            pytest.fail(f"application {name!r} needs {needed:g} CPUs, the session cluster has "
                        f"{free:g} free; applications up: {up} (remove what a module no longer "
                        "needs: deploy.remove)")  # fmt: skip
        time.sleep(0.5)


def _with_remove(deploy_fn: Callable[..., Any], apps: dict[str, Any]) -> Iterator[Any]:
    """Yield ``deploy_fn`` with a ``remove(*names)`` that deletes applications now: their CPU
    share is free for the tests after it (the session's cluster has 2 CPUs). An application is
    deleted at the end of the module that deployed it, unless deployed with ``keep=True``
    (then at the session's end)."""

    def remove(*names: str) -> None:
        _delete_apps([name for name in names if apps.pop(name, None) is not None])

    def deploy(name: str, *args: Any, keep: bool = False, **overrides: Any) -> Any:
        new = name not in apps
        app = deploy_fn(name, *args, **overrides)
        if new and not keep:
            _MODULE_APPS.append((apps, name))
        return app

    deploy.remove = remove  # type: ignore[attr-defined]
    yield deploy
    _delete_apps(list(apps))


@pytest.fixture(scope="session")
def deploy(serve_url: str, tiny_models: dict[str, Path],
           batching_limits: dict[str, int]) -> Iterator[Callable[..., App]]:  # fmt: skip

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
        preprocess = _cpus(cfg.preprocess) if cfg.preprocess_at == "deployment" else 0.0
        _wait_for_cpus(name, _cpus(cfg.encoder) + _cpus(cfg.ingress) + preprocess)
        serve_app(build_application(cfg), name=name, route_prefix=f"/{name}")
        apps[name] = App(name, f"{serve_url}/{name}", cfg)
        return apps[name]

    yield from _with_remove(_deploy, apps)


@pytest.fixture(scope="session")
def main_app(deploy: Callable[..., App]) -> App:
    """The application most tests share: batching on (a longer wait, so concurrent requests
    reliably meet), limits small enough to test cheaply."""
    return deploy(
        "main",
        keep=True,
        batching={"batch_wait_timeout_s": 0.2},
        limits={"max_images_per_request": 8, "max_request_bytes": 3 * 2**20,
                "max_image_bytes": 2 * 2**20, "max_image_pixels": 4_000_000},
    )  # fmt: skip


@pytest.fixture(scope="session")
def family_apps(deploy: Callable[..., App], tiny_models: dict[str, Path]) -> dict[str, App]:
    """family -> an application serving that family's tiny model (fp32), for the modules that
    need every family (``test_adapters``, ``test_prefill``): started at once (each takes seconds,
    mostly its replicas' start-up) and kept for the session, so they start once."""
    import concurrent.futures as cf

    from vitserve.encoder.loading import load_preprocessor
    from vitserve.encoder.testmodels import FAMILIES

    for family in FAMILIES:  # transformers resolves classes lazily, not thread safe
        load_preprocessor(str(tiny_models[family]))

    def start(family: str) -> App:  # the smallest CPU shares: they hold them to the end
        return deploy(f"fam-{family}", keep=True, model=str(tiny_models[family]),
                      **{"encoder.num_cpus": 0.01, "ingress.num_cpus": 0.01})  # fmt: skip

    with cf.ThreadPoolExecutor(len(FAMILIES)) as pool:
        return dict(zip(FAMILIES, pool.map(start, FAMILIES), strict=True))


@dataclass
class ChatApp:
    """A deployed prefill application (its encoder application beside it)."""

    name: str
    url: str  # base of the OpenAI routes: POST {url}/v1/chat/completions
    encoder: App
    config: Any
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=300))

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        return self.client.post(f"{self.url}/v1/chat/completions", json=body)

    def as_app(self) -> App:
        """This application's /metrics helpers (``metric``, ``wait_metric``)."""
        return App(self.name, self.url, self.config)


@pytest.fixture(scope="session")
def deploy_prefill(deploy: Callable[..., App]) -> Iterator[Callable[..., ChatApp]]:
    """``deploy_prefill(name, encoder, **overrides)``: the prefill application ``name`` (route
    ``/<name>``) over ``encoder``'s model, reaching ``encoder`` by its handle and reading the
    rows from its store directly. ``deploy_prefill.remove(name)`` deletes it."""

    from vitserve.deployments.config import VitserveConfig
    from vitserve.deployments.local import serve_app
    from vitserve.deployments.prefill import build_prefill_application

    apps: dict[str, ChatApp] = {}

    def _deploy(name: str, encoder: App, **overrides: Any) -> ChatApp:
        if name in apps:
            return apps[name]
        base = {
            **encoder.config.model_dump(),
            "prefill": {"encoder_app": encoder.name, "route_prefix": f"/{name}",
                        "num_cpus": 0.05, "chunk_size": 16},
        }  # fmt: skip
        cfg = VitserveConfig.load({**base, **overrides})
        _wait_for_cpus(name, _cpus(cfg.prefill))
        serve_app(build_prefill_application(cfg), name=name, route_prefix=f"/{name}")
        base_url = encoder.url.rsplit("/", 1)[0]
        apps[name] = ChatApp(name, f"{base_url}/{name}", encoder, cfg)
        return apps[name]

    yield from _with_remove(_deploy, apps)


# -- the reliability table (tests/reliability_table.py) -----------------------------------------
@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Any:
    """``reliability.record(case, tried=, failed=, wrong=, lost=, note=)``: one row of the
    README's reliability table, rerun by this test's node id. Call it after the assertions."""
    import tests.reliability_table as table

    class Recorder:
        @staticmethod
        def record(case: str, **counts: Any) -> table.Row:
            rerun = f".venv/bin/python -m pytest '{request.node.nodeid}'"
            return table.record(case, rerun=rerun, **counts)

    return Recorder()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    import tests.reliability_table as table

    if not table.ROWS:
        return
    text = table.render(table.ROWS)
    path = table.report_path(Path(terminalreporter.config.rootpath))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table.render(table.ROWS, header=True))
    terminalreporter.write_sep("=", f"reliability table ({len(table.ROWS)} rows, also in {path})")
    terminalreporter.write(text)
