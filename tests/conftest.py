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

from tests import gpu, machine_cpu
from tests.redis_process import RedisClusterServers, RedisServer

# tests/vllm runs against real vLLM servers from vLLM's own venv: `make test-vllm` runs it (and
# sets VITSERVE_TEST_VLLM=1); `make test` leaves it out.
collect_ignore = [] if os.environ.get("VITSERVE_TEST_VLLM") == "1" else ["vllm"]
# tests/multinode drives a multi-node Ray cluster of its own, so it runs in a pytest process of
# its own (`make test-multinode` sets VITSERVE_TEST_MULTINODE=1); `make test` leaves it out.
if os.environ.get("VITSERVE_TEST_MULTINODE") != "1":
    collect_ignore.append("multinode")

pytest_plugins = ["pytester"]  # tests/test_fast_tier.py runs the tier's rules in an inner session

# Nothing in the suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a tiny random-weight full VLM saved with save_pretrained."""
    from vitserve.testing.models import FAMILIES, make_model

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

    from vitserve.deployments.runner.local import LOCAL_SYSTEM_CONFIG

    if not ray.is_initialized():
        # address="local": a new cluster of this session, never one left running on the
        # machine (ray.init() alone would join a `ray start` cluster). Metrics reach the
        # node's endpoint every second (default 10 s), so tests of /metrics wait briefly.
        # Workers at the embedded runner's niceness (0, not Ray's 15): else the test's own
        # client threads, at nice 0, take the CPU from the replicas they load.
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            namespace="vitserve-tests",
            logging_level="warning",
            _system_config={"metrics_report_interval_ms": 1000, **LOCAL_SYSTEM_CONFIG},
        )
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
def redis_cluster_url() -> Iterator[str]:
    """The suite's Redis Cluster: ``VITSERVE_TEST_REDIS_CLUSTER`` (.ci/run starts one: three
    primaries, three replicas, loopback), else one of the session's own, the same shape."""
    url = os.environ.get("VITSERVE_TEST_REDIS_CLUSTER")
    if url:
        yield url
        return
    cluster = RedisClusterServers(masters=3, replicas=1)
    yield cluster.url
    cluster.close()


@pytest.fixture
def spawn_redis_cluster() -> Iterator[Callable[..., RedisClusterServers]]:
    """Private Redis Clusters (``RedisClusterServers(masters, replicas, node_timeout_ms,
    args)``), killed at teardown: for tests that kill nodes or set their memory."""
    clusters: list[RedisClusterServers] = []

    def spawn(**kwargs: Any) -> RedisClusterServers:
        clusters.append(RedisClusterServers(**kwargs))
        return clusters[-1]

    yield spawn
    for cluster in clusters:
        cluster.close()


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

    def encoder_counters(self, replicas: int, rounds: int = 25) -> dict[str, dict[str, Any]]:
        """``counters()`` of each of the encoder's ``replicas`` replicas, by replica id: Serve
        routes a call to one of them, so calls go eight at a time until each has answered."""
        handle, seen = self.encoder(), {}
        for _ in range(rounds):
            for call in [handle.counters.remote() for _ in range(8)]:
                answer = call.result()
                seen[answer["replica"]] = answer
            if len(seen) == replicas:
                return seen
        raise AssertionError(f"{len(seen)} of {replicas} encoder replicas answered")

    def stats(self) -> dict[str, Any]:
        """The ingress's ``counts()`` by handle (what ``GET /v1/stats`` serves): its own
        counters and an encoder replica's, each side's ``counts`` a ``metrics.Counts``."""
        from ray import serve

        return serve.get_deployment_handle("Ingress", app_name=self.name).counts.remote().result()

    def encode(self, images: list[bytes]) -> httpx.Response:
        files = [
            ("images", (f"{i}.img", b, "application/octet-stream")) for i, b in enumerate(images)
        ]
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
            return sum(
                v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in wanted)
            )

        return value

    def metric(self, name: str, **labels: str) -> float:
        """The sum of this application's samples of ``name`` that match ``labels``."""
        return self.page()(name, **labels)

    def wait_page(
        self, predicate: Callable[[Callable[..., float]], bool], timeout: float = 20
    ) -> Callable[..., float]:
        """Poll /metrics until ``predicate(page)`` holds (Ray reports every second here); the
        last page either way."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.page()
            if predicate(page) or time.monotonic() > deadline:
                return page
            time.sleep(0.5)

    def wait_metric(
        self, name: str, predicate: Callable[[float], bool], timeout: float = 20, **labels: str
    ) -> float:
        """``wait_page`` for one value; the last value either way."""
        return self.wait_page(lambda page: predicate(page(name, **labels)), timeout)(name, **labels)


@pytest.fixture(scope="session")
def serve_url(ray_cluster) -> Iterator[str]:
    from ray import serve

    from vitserve.deployments.runner.local import free_port, start_serve

    yield start_serve("127.0.0.1", free_port())
    serve.shutdown()


# The applications the running test module deployed, as (registry, name): deleted when the
# module ends (``_remove_module_apps``), so that a module never finds the session cluster's 2 CPUs
# taken by the applications of the modules before it. ``keep=True`` exempts the shared
# applications (``main_app``, ``family_apps``, ``node_app``, ``redis_app``): each is deleted after
# the last test of the run that uses it (``shared_apps`` below).
_MODULE_APPS: list[tuple[dict[str, Any], str]] = []


def _delete_apps(names: list[str], timeout: float = 120) -> None:
    """Delete the applications ``names`` together and return once Serve has removed them (one
    by one, each ``serve.delete`` waits ~3 s for its replicas to stop)."""
    if not names:  # nothing to ask Serve (a module of unit tests may never have started it)
        return
    from ray import serve

    from vitserve.deployments.runner.local import application_statuses

    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout
    while left := set(names) & set(application_statuses()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"applications not deleted after {timeout} s: {sorted(left)}")
        time.sleep(0.2)


@pytest.fixture(scope="module", autouse=True)
def _remove_module_apps() -> Iterator[None]:
    start = len(_MODULE_APPS)
    yield
    _delete_apps(
        [name for registry, name in _MODULE_APPS[start:] if registry.pop(name, None) is not None]
    )
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
            pytest.fail(
                f"application {name!r} needs {needed:g} CPUs, the session cluster has "
                f"{free:g} free; applications up: {up} (remove what a module no longer "
                "needs: deploy.remove)"
            )
        time.sleep(0.1)


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
    _REMOVERS.append(remove)
    yield deploy
    _REMOVERS.remove(remove)
    _delete_apps(list(apps))


# A stopping replica checks every graceful_shutdown_wait_loop_s that its requests in flight are
# done (Serve's default 2 s): every application the suite deletes would wait that long.
STOP_POLL_S = 0.1
SECTIONS = ("encoder", "preprocess", "ingress", "prefill", "vllm")


@pytest.fixture(scope="session")
def deploy(
    serve_url: str, tiny_models: dict[str, Path], batching_limits: dict[str, int]
) -> Iterator[Callable[..., App]]:

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.app import build_application
    from vitserve.deployments.runner.local import serve_app

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
            **{f"{section}.graceful_shutdown_wait_loop_s": STOP_POLL_S for section in SECTIONS},
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
        limits={
            "max_images_per_request": 8,
            "max_request_bytes": 3 * 2**20,
            "max_image_bytes": 2 * 2**20,
            "max_image_pixels": 4_000_000,
        },
    )


# The shared applications: one per store kind and model that modules need plainly ("an encoder
# application over store X"), default settings, with the smallest CPU shares. A module that
# needs other settings deploys its own.
SHARED_CPUS = {"encoder.num_cpus": 0.01, "ingress.num_cpus": 0.01}


SHARED_FIXTURES = ("main_app", "family_apps", "node_app", "redis_app")


def shared_apps() -> dict[str, tuple[str, ...]]:
    """The applications each of SHARED_FIXTURES deploys with ``keep=True``."""
    from vitserve.testing.models import FAMILIES

    return {
        "main_app": ("main",),
        "family_apps": tuple(f"fam-{family}" for family in FAMILIES),
        "node_app": ("fam-qwen2_vl",),
        "redis_app": ("redis",),
    }


# Each shared application is deleted once the last test of the run that uses it (through one of
# SHARED_FIXTURES) is torn down, not at the session's end: an idle application's replicas and
# the controller's loop over them cost the cluster CPU all along (measured here: ~2% of the two
# cores per idle application), and the suite is CPU-bound. The last users are found once the
# run's tests are selected.
_REMOVERS: list[Callable[..., None]] = []  # the session's deploy.remove (one, while it is up)
_RELEASE = pytest.StashKey[dict[str, list[str]]]()  # test node id -> applications to delete


def pytest_collection_finish(session: pytest.Session) -> None:
    fixtures = {name for item in session.items for name in item.fixturenames}
    if not fixtures.intersection(SHARED_FIXTURES):
        return  # no shared application in this run (and no need to import the families)
    last: dict[str, str] = {}
    by_fixture = shared_apps()
    for item in session.items:
        for fixture, apps in by_fixture.items():
            if fixture in item.fixturenames:
                last.update(dict.fromkeys(apps, item.nodeid))
    release: dict[str, list[str]] = {}
    for app, nodeid in last.items():
        release.setdefault(nodeid, []).append(app)
    session.config.stash[_RELEASE] = release


@pytest.hookimpl(trylast=True)  # after the test's own teardown (its module's applications)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    apps = item.config.stash.get(_RELEASE, {}).get(item.nodeid)
    if apps and _REMOVERS:
        _REMOVERS[-1](*apps)


def _family_app(deploy: Callable[..., App], tiny_models: dict[str, Path], family: str) -> App:
    return deploy(f"fam-{family}", keep=True, model=str(tiny_models[family]), **SHARED_CPUS)


@pytest.fixture(scope="session")
def family_apps(deploy: Callable[..., App], tiny_models: dict[str, Path]) -> dict[str, App]:
    """family -> an application serving that family's tiny model (fp32) over the node-local
    store, for the modules that need every family (``test_adapters``, ``test_prefill``): started
    at once (each takes seconds, mostly its replicas' start-up), so they start once."""
    import concurrent.futures as cf

    from vitserve.encoder.loading import load_preprocessor
    from vitserve.testing.models import FAMILIES

    for family in FAMILIES:  # transformers resolves classes lazily, not thread safe
        load_preprocessor(str(tiny_models[family]))

    with cf.ThreadPoolExecutor(len(FAMILIES)) as pool:
        started = pool.map(lambda f: _family_app(deploy, tiny_models, f), FAMILIES)
        return dict(zip(FAMILIES, started, strict=True))


@pytest.fixture(scope="session")
def node_app(deploy: Callable[..., App], tiny_models: dict[str, Path]) -> App:
    """The encoder application over the node-local store (the embedded default) and the tiny
    Qwen2-VL, default settings: ``family_apps``' Qwen2-VL one."""
    return _family_app(deploy, tiny_models, "qwen2_vl")


@pytest.fixture(scope="session")
def redis_app(deploy: Callable[..., App], redis_url: str) -> App:
    """The encoder application over the suite's Redis and the tiny Qwen2-VL, default settings
    (clients and prefill applications read the store directly)."""
    return deploy("redis", keep=True, store=redis_url, **SHARED_CPUS)


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

    def counts(self) -> Any:
        """The prefill replica's ``counts()`` by handle: a ``metrics.Counts``."""
        from ray import serve

        handle = serve.get_deployment_handle("PrefillServer", app_name=self.name)
        return handle.counts.remote().result()


@pytest.fixture(scope="session")
def deploy_prefill(deploy: Callable[..., App]) -> Iterator[Callable[..., ChatApp]]:
    """``deploy_prefill(name, encoder, **overrides)``: the prefill application ``name`` (route
    ``/<name>``) over ``encoder``'s model, reaching ``encoder`` by its handle and reading the
    rows from its store directly. ``deploy_prefill.remove(name)`` deletes it."""

    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.prefill.app import build_prefill_application
    from vitserve.deployments.runner.local import serve_app

    apps: dict[str, ChatApp] = {}

    def _deploy(name: str, encoder: App, **overrides: Any) -> ChatApp:
        if name in apps:
            return apps[name]
        base = {
            **encoder.config.model_dump(),
            "prefill": {
                "encoder_app": encoder.name,
                "route_prefix": f"/{name}",
                "num_cpus": 0.05,
                "chunk_size": 16,
                "graceful_shutdown_wait_loop_s": STOP_POLL_S,
            },
        }
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
    reliability table (the README links it), rerun by this test's node id. Call it after the
    assertions."""
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


# -- tiers: `make test-fast` ---------------------------------------------------------------------
# Every test is marked by what it starts or talks to: ``ray`` (a Ray cluster, Serve on it),
# ``redis`` (a Redis server), ``subprocess`` (a new process: redis-server, the console script,
# kubectl, a fresh interpreter), and ``heavy`` when it has any of them. The marks come from the
# fixtures a test uses (their closure: ``main_app`` brings ``deploy``, ``serve_url`` and
# ``ray_cluster``; ``make_store`` by its store kind, STORE_KIND_NEEDS) and, for a test that
# starts one without a suite fixture, from HEAVY_TESTS; nobody writes them on a test. ``slow``
# comes from SLOW_TESTS: tests that need none of them but take seconds of CPU. ``make test-fast``
# runs ``-m "not heavy and not slow"``; ``make test`` runs everything.
#
# ``gpu`` is written by hand on the tests that run a CUDA path (it cannot be read from their
# fixtures). It adds neither ``heavy`` nor ``slow``: such a test needs no server or process,
# so it stays in the fast tier unless its fixtures make it heavy, and without a GPU it is
# skipped at setup, before its fixtures, in milliseconds. On a GPU machine the tier runs it.
# When it runs, skips or fails is tests/gpu.py's rule (``make test-gpu``: ``-m gpu`` with
# ``VITSERVE_REQUIRE_GPU=1``, where a missing GPU fails instead of skipping).
#
# Invariants:
# - A run that selects no heavy test runs under FastTierGuard: ``ray.init``, a Redis connection
#   and a new process raise TierViolation, and the test that tried fails even if it caught it.
#   A test the marks miss fails the fast tier instead of slowing it down.
# - Marks only add: a hand-written ``ray``/``redis``/``subprocess`` mark makes a test heavy, a
#   hand-written ``slow`` stays.
# - Every fixture and test named below exists (tests/test_fast_tier.py checks).
# - A ``gpu`` test is skipped, or failed in its call, without any of its fixtures set up when
#   CUDA is not usable (tests/test_gpu_tier.py checks); its mark alone makes it neither heavy
#   nor slow.

FIXTURE_NEEDS: dict[str, tuple[str, ...]] = {
    "ray_cluster": ("ray",),  # serve_url, deploy, main_app, family_apps, deploy_prefill over it
    "redis_url": ("redis",),
    "lru_redis_url": ("redis", "subprocess"),
    "spawn_redis": ("redis", "subprocess"),
    "redis_cluster_url": ("redis", "subprocess"),  # starts one unless .ci/run did
    "multinode": ("ray", "subprocess"),  # tests/multinode: a multi-node cluster of its own
    "spawn_redis_cluster": ("redis", "subprocess"),
    "kustomize": ("subprocess",),  # tests/k8s: render runs `kubectl kustomize`
}

# What tests/cache's ``make_store`` needs for each store kind it is parametrized with (it asks
# for Ray or Redis only when it opens a store of a kind that needs one).
STORE_KIND_NEEDS: dict[str, tuple[str, ...]] = {
    "memory": (),
    "node": ("ray",),
    "redis": ("redis",),
    "tiered": ("redis",),
    "redis-cluster": ("redis", "subprocess"),
}

# Tests (a folder, a module, or a module::test for all its parameters) that start Ray, Redis or
# a process without a fixture above: the fast tier's guard found each of them.
_CLI = "tests/deployments/test_cli.py::"
HEAVY_TESTS: dict[str, tuple[str, ...]] = {
    # real vLLM servers beside `vitserve serve` (make test-vllm; make test leaves them out)
    "tests/vllm/": ("ray", "redis", "subprocess"),
    "tests/test_layering.py": ("subprocess",),  # fresh interpreters, pip wheel
    # a Redis connection to a port nobody listens on; a fresh interpreter without `redis`
    "tests/client/test_ec_config.py::test_a_store_merely_down_at_start_is_not_an_error": ("redis",),
    "tests/client/test_ec_config.py::"
    "test_a_store_whose_client_library_is_missing_is_refused_naming_it": ("subprocess",),
    # two small processes whose CPU and wakeups it reads
    "tests/loadtest/test_bench_idle.py::test_a_trees_cpu_and_wakeups_are_counted_per_process": (
        "subprocess",
    ),
    "tests/fuzz/test_atheris.py": ("subprocess",),
    "tests/k8s/test_tooling.py": ("subprocess",),  # hadolint, kubernetes-validate
    # the documentation site: git ls-files, mkdocs builds of a copy of the repository
    "tests/docs/test_site.py::test_the_site_builds_strict_with_every_page_and_the_results": (
        "subprocess",
    ),
    "tests/docs/test_site.py::test_a_broken_link_fails_the_build": ("subprocess",),
    # the documentation's snippets: `vitserve serve` and the CLI, the SDK, models made offline
    "tests/docs/test_snippets.py::test_a_pages_snippets_run": ("ray", "subprocess"),
    "tests/docs/test_snippets.py::test_the_getting_started_server_answers_every_client_snippet": (
        "ray",
        "subprocess",
    ),
    "tests/deployments/test_exposure.py::"
    "test_serve_as_a_user_runs_it_keeps_rays_token_auth_on_every_port_beyond_loopback": (
        "ray",
        "subprocess",
    ),
    # node:// asks for the Ray cluster by getfixturevalue (the memory:// case goes with it)
    "tests/cache/test_views.py::test_closing_the_owner_gives_up_the_connections_claims": ("ray",),
    "tests/loadtest/test_bench_client.py::test_each_script_answers_help_with_its_own_flags": (
        "subprocess",
    ),
    "tests/loadtest/test_bench_client.py::test_the_fetch_script_measures_a_short_run": (
        "ray",
        "subprocess",
    ),
    # the harness's driver, locust and the open-loop generator against a stand-in server
    "tests/loadtest/test_harness_run.py": ("subprocess",),
    # matplotlib's first use on a machine runs `fc-list` (a process) for its font cache
    "tests/loadtest/test_report.py::test_plots_are_written": ("subprocess",),
    # its encodes run in a child process of their own (its RSS is the measure); .ci/run selects
    # it alone (-k 64_images), where a test the marks miss meets the fast-tier guard
    "tests/reliability/test_overload.py::"
    "test_64_images_at_2k_encode_within_the_activation_budget": ("subprocess",),
    "tests/client/test_adapters.py::test_importing_the_adapters_loads_no_torch": ("subprocess",),
    "tests/test_tiers.py::test_the_durations_page_names_its_machine_and_commit": ("subprocess",),
    "tests/client/test_client.py::test_importing_the_client_loads_no_heavy_dependency": (
        "subprocess",
    ),
    "tests/encoder/test_allocator.py::test_cpu_allocator_tuning_stops_refaulting_large_buffers": (
        "subprocess",
    ),
    "tests/encoder/test_language_model.py::test_importing_the_loader_loads_no_torch": (
        "subprocess",
    ),
    "tests/encoder/test_work.py::test_decode_bytes_over_estimate_the_measured_peak": (
        "subprocess",
    ),
    f"{_CLI}test_make_model_writes_a_loadable_sharded_checkpoint": ("subprocess",),
    f"{_CLI}test_make_model_for_vllm_has_heads_vllms_cpu_attention_takes": ("subprocess",),
    f"{_CLI}test_make_model_rejects_unknown_family": ("subprocess",),
    f"{_CLI}test_encode_against_no_server_fails_clearly": ("subprocess",),
    f"{_CLI}test_without_the_server_extra_the_script_names_it": ("subprocess",),
    "tests/deployments/test_auth.py::test_vitserve_encode_takes_a_token_by_flag_or_environment": (
        "subprocess",
    ),
    f"{_CLI}test_the_script_has_a_version_help_for_each_command_and_vllms_dtype_names": (
        "subprocess",
    ),
    f"{_CLI}test_demo_with_a_missing_model_fails_clearly_before_starting_anything": ("subprocess",),
    f"{_CLI}test_serve_demo_with_prefill_then_encode_and_chat_through_http_then_ctrl_c": (
        "subprocess",
        "ray",
    ),
    f"{_CLI}test_demo_serves_encodes_twice_and_the_second_pass_comes_from_the_store": (
        "subprocess",
        "ray",
    ),
    "tests/cache/test_redis_security.py::test_tls_with_client_certificate_and_acl_user": (
        "redis",
        "subprocess",
    ),  # tls_server: a redis-server of its own
    # server: a redis-server of its own; manifest: runs Redis' init container (vitserve)
    "tests/k8s/test_redis_acl.py": ("redis", "subprocess"),
    "tests/k8s/test_redis_cluster_manifest.py": ("redis", "subprocess"),
    # its application and Redis come from request.getfixturevalue
    "tests/reliability/test_faults.py::test_a_replica_killed_mid_load": (
        "ray",
        "redis",
        "subprocess",
    ),
    # a private redis-server with a reader user per tenant (its module fixture)
    "tests/reliability/test_cross_tenant.py": ("ray", "redis", "subprocess"),
}

# Tests (named as in HEAVY_TESTS) that need no server or process but took over 2 s of a 2-vCPU
# machine's time in a fast-tier run (pytest --durations=0, all their parameters together):
# towers compared across every family, hypothesis searches (a hand-written ``slow`` counts too).
SLOW_TESTS = frozenset(
    {
        "tests/encoder/test_families.py",
        "tests/encoder/test_language_model.py::test_image_embeddings_give_the_full_models_logits",
        "tests/encoder/test_language_model.py::test_vision_bytes_are_never_read",
        "tests/encoder/test_language_model.py::test_other_checkpoint_layout_loads_the_same_model",
        "tests/encoder/test_loading.py::test_reads_only_vision_tensors",
        "tests/encoder/test_loading.py::test_other_naming_layouts_load",
        "tests/encoder/test_work.py::test_the_packed_rule_over_many_sizes",
        "tests/fuzz/test_request_parsing.py::test_every_parser_parses_or_refuses_any_input",
        "tests/fuzz/test_image_properties.py::test_decompression_bombs_are_refused_before_decoding",
        "tests/fuzz/test_image_properties.py::test_arbitrary_and_mutated_images",
        "tests/fuzz/test_codec_properties.py::test_a_buggy_writers_headers_never_crash_the_reader",
        "tests/fuzz/test_codec_properties.py::test_valid_records_round_trip_exactly",
        "tests/fuzz/test_codec_properties.py::test_damaged_values_are_refused_never_misread",
    }
)

HEAVY_MARKS = ("ray", "redis", "subprocess")

# -- tiers: `make test` and `make test-system` ---------------------------------------------------
# ``system`` marks what `make test` (the suite a developer runs before each commit) leaves to
# `make test-system` (a step of .ci/run): tests that start a whole cluster or server of their own
# (the `vitserve` script, Ray in a child process, a Redis Cluster from the manifests), inject a
# fault (a replica, store or primary killed or restarted) or drive a load (an overload, bursts,
# a simulated or generated load run). ``fuzz`` marks the tests whose budget tests/fuzz/budget.py
# sets: `make test` runs them at a fifth of it, `make test-system` again at full budget. Both
# come from the lists below (named as in HEAVY_TESTS); nobody writes them on a test.
#
# Invariants:
# - `make test` (``-m "not system"``) and `make test-system` (``-m "system or fuzz"``) together
#   run every test `pytest` collects; only the fuzz tests run in both.
# - Every test named below exists (tests/test_fast_tier.py checks).
_PREFILL = "tests/deployments/test_prefill_service.py::"
SYSTEM_TESTS = frozenset(
    {
        "tests/reliability/",  # fault loads, overload, shutdown, cross-tenant over every route
        # `vitserve serve` / `vitserve demo`: a Ray cluster of their own each
        f"{_CLI}test_serve_demo_with_prefill_then_encode_and_chat_through_http_then_ctrl_c",
        f"{_CLI}test_demo_serves_encodes_twice_and_the_second_pass_comes_from_the_store",
        "tests/deployments/test_exposure.py::"
        "test_serve_as_a_user_runs_it_keeps_rays_token_auth_on_every_port_beyond_loopback",
        "tests/loadtest/test_bench_client.py::test_the_fetch_script_measures_a_short_run",
        "tests/loadtest/test_harness_run.py",  # the harness's driver, locust, open-loop load
        "tests/k8s/test_redis_cluster_manifest.py",  # six Redis pods' commands and the bootstrap
        # faults: replicas restarted or scaled, a store killed, a primary killed under load
        f"{_PREFILL}test_the_encoder_restarted_or_scaled_while_prefill_serves",
        f"{_PREFILL}test_the_prefill_restarted_or_scaled_while_the_encoder_serves",
        "tests/client/test_client.py::test_an_encoder_restart_between_calls_is_retried",
        "tests/client/test_client.py::test_a_store_outage_is_reported_as_such_and_recovers",
        "tests/deployments/test_service.py::"
        "test_a_store_that_is_down_gives_503_for_fetches_while_encodes_still_answer",
        "tests/cache/test_redis_cluster.py::test_a_primary_killed_under_load_fails_over",
        # loads: an overload, bursts past the replicas' room, the autoscaling simulation
        "tests/deployments/test_service.py::test_an_overloaded_encoder_answers_429_with_retry_after",
        "tests/deployments/test_routing_serve.py::"
        "test_a_burst_past_the_replicas_room_waits_in_the_router_for_its_hold",
        "tests/deployments/test_autoscaling.py::"
        "test_simulation_work_policy_and_router_hold_the_target_and_beat_serves",
    }
)
FUZZ_TESTS = frozenset({"tests/fuzz/"})

# The processes the fast tier's guard lets through: what vitserve's own code runs to probe the
# host (ctypes.util.find_library("c") runs `ldconfig -p`), milliseconds, not a server.
HOST_PROBES = frozenset({"ldconfig"})


def _keys(item: pytest.Item) -> tuple[str, ...]:
    """The keys the lists may name ``item`` by: its folders (``tests/vllm/``), its module and
    its module::test without parameters."""
    path = item.nodeid.partition("::")[0]
    parts = path.split("/")
    folders = ["/".join(parts[:i]) + "/" for i in range(1, len(parts))]
    return *folders, path, item.nodeid.partition("[")[0]


def tier_needs(item: pytest.Item) -> set[str]:
    """The marks of HEAVY_MARKS that ``item`` needs (see above)."""
    needs = {m for name in item.fixturenames for m in FIXTURE_NEEDS.get(name, ())}
    if "make_store" in item.fixturenames:  # its kind asks for Ray or Redis when it opens one
        needs.update(STORE_KIND_NEEDS[item.callspec.params["make_store"]])
    needs.update(m for key in _keys(item) for m in HEAVY_TESTS.get(key, ()))
    needs.update(m for m in HEAVY_MARKS if item.get_closest_marker(m))
    return needs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        needs = tier_needs(item)
        for mark in sorted(needs):
            item.add_marker(mark)
        if needs:
            item.add_marker("heavy")
        if not item.get_closest_marker("slow") and SLOW_TESTS.intersection(_keys(item)):
            item.add_marker("slow")
        if SYSTEM_TESTS.intersection(_keys(item)):
            item.add_marker("system")
        if FUZZ_TESTS.intersection(_keys(item)):
            item.add_marker("fuzz")


class TierViolation(Exception):
    """A test of the fast tier started Ray, reached Redis or started a process (not a
    RuntimeError: code that retries on those, as TlsRedisServer.start does, must not hide it)."""


class FastTierGuard:
    """While entered, ``ray.init``, a Redis connection (sync or asyncio) and a new process
    (``subprocess``, ``os.system``, ``os.posix_spawn``, ``os.fork``) raise TierViolation;
    ``violations`` lists each attempt, so a test that swallowed the error still fails."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._patch = pytest.MonkeyPatch()

    def _refuse(self, what: str, mark: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self.violations.append(what)
            raise TierViolation(
                f"{what} in a fast-tier run: give the test a fixture that brings the `{mark}` "
                "mark or add it to HEAVY_TESTS in tests/conftest.py"
            )

        return refuse

    def __enter__(self) -> FastTierGuard:
        import importlib.util
        import subprocess

        patch = self._patch.setattr
        # Ray or redis-py not installed (a GPU machine running only `-m gpu`, without the
        # server extra): nothing in the run can start Ray or connect, so nothing to refuse.
        if importlib.util.find_spec("ray") is not None:
            import ray

            patch(ray, "init", self._refuse("ray.init", "ray"))
            patch(ray._private.worker, "init", self._refuse("ray.init", "ray"))
        if importlib.util.find_spec("redis") is not None:
            import redis.asyncio.connection
            import redis.connection

            for module in (redis.connection, redis.asyncio.connection):
                refuse = self._refuse("a Redis connection", "redis")
                patch(module.AbstractConnection, "connect", refuse)
        refuse_process = self._refuse("a subprocess", "subprocess")
        execute_child = subprocess.Popen._execute_child

        def execute_unless_refused(popen: subprocess.Popen, args: Any, *rest: Any) -> Any:
            argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
            if os.path.basename(os.fsdecode(argv[0])) not in HOST_PROBES:
                refuse_process()
            return execute_child(popen, args, *rest)

        patch(subprocess.Popen, "_execute_child", execute_unless_refused)
        for name in ("system", "posix_spawn", "posix_spawnp", "fork"):
            patch(os, name, self._refuse(f"os.{name}", "subprocess"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.undo()


_GUARD = pytest.StashKey[FastTierGuard]()


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    """Run the tests under FastTierGuard when none of them is heavy."""
    if not session.items or any(item.get_closest_marker("heavy") for item in session.items):
        return (yield)
    with FastTierGuard() as guard:
        session.config.stash[_GUARD] = guard
        try:
            return (yield)
        finally:
            del session.config.stash[_GUARD]


_VIOLATIONS_BEFORE = pytest.StashKey[int]()
_FAILED = pytest.StashKey[bool]()
_GPU_FAILURE = pytest.StashKey[str]()  # why a gpu test fails (tests/gpu.py), set at its setup


_CPU_AT_SETUP = pytest.StashKey[float | None]()  # the machine's busy seconds (machine_cpu)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_SETUP] = machine_cpu.read()
    if (guard := item.config.stash.get(_GUARD, None)) is not None:
        item.stash[_VIOLATIONS_BEFORE] = len(guard.violations)
    if item.get_closest_marker("gpu"):
        _gpu_gate(item)


def _gpu_gate(item: pytest.Item) -> None:
    """tests/gpu.py's rule for a ``gpu`` test, before its fixtures: skip it here, or note the
    failure that its call reports (a FAILED test, not an error in setup) and leave its
    fixtures unset: pytest sets up only the fixtures missing from ``item.funcargs``, and a
    model built or a device touched for a test that fails anyway costs time or hides why."""
    try:
        reason = gpu.gpu_precondition(gpu.probe(), os.environ.get(gpu.REQUIRE_ENV))
    except gpu.GpuPreconditionError as exc:
        item.stash[_GPU_FAILURE] = str(exc)
        if isinstance(item, pytest.Function):
            item.funcargs.update(dict.fromkeys(item.fixturenames, None))
        return
    if reason is not None:
        pytest.skip(reason)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if (failure := item.stash.get(_GPU_FAILURE, None)) is not None:
        pytest.fail(failure, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[Any]:
    """Fail a test that tried what the fast tier's guard refuses, even if it caught the error
    (its teardown's report fails unless its setup or call already did), and say what it tried
    in the report of the phase that failed. After its teardown, record the machine's CPU
    from its setup on (tests/machine_cpu.py) for its junit XML entry."""
    if call.when == "teardown":
        start, now = item.stash.get(_CPU_AT_SETUP, None), machine_cpu.read()
        if start is not None and now is not None:
            item.user_properties.append((machine_cpu.PROPERTY, f"{now - start:.2f}"))
    report = yield
    guard = item.config.stash.get(_GUARD, None)
    if guard is None:
        return report
    tried = guard.violations[item.stash.get(_VIOLATIONS_BEFORE, len(guard.violations)) :]
    said = f"tried {', '.join(tried)} in a fast-tier run"
    if report.failed and tried:
        report.sections.append(("fast-tier guard", said))
    elif call.when == "teardown" and tried and not item.stash.get(_FAILED, False):
        report.outcome = "failed"
        report.longrepr = f"{said} (and caught the error)"
    if report.failed:
        item.stash[_FAILED] = True
    return report
