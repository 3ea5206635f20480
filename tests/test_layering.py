"""The dependency rules of the design brief, checked in fresh interpreters, and packaging."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _all_modules_after(code: str) -> set[str]:
    """Every module (its whole dotted name) a fresh interpreter holds after running ``code``."""
    code = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def _modules_after(code: str) -> set[str]:
    return {name.split(".")[0] for name in _all_modules_after(code)}


def _modules_after_import(module: str) -> set[str]:
    return _modules_after(f"import {module}")


def test_encoder_never_imports_ray_redis_or_http(tiny_models) -> None:
    """A whole encode (load, decode, preprocess, forward) loads no Ray, Redis or HTTP code."""
    loaded = _modules_after(
        "from vitserve.encoder.engine import EncoderEngine\n"
        "from vitserve.testing.images import make_image\n"
        f"engine = EncoderEngine.from_pretrained({str(tiny_models['qwen3_vl'])!r})\n"
        "assert engine.encode([make_image(64, 64)])[0].num_tokens > 0\n"
    )
    assert {"torch", "transformers"} <= loaded  # else the check would be vacuous
    assert not loaded & {"ray", "redis", "httpx", "fastapi", "starlette", "aiohttp"}


def test_the_gpu_tests_need_no_ray_or_redis() -> None:
    """The ``gpu`` tests run, file by file, on a GPU machine that may hold torch and no server
    extra: what they import (the engine, the publish path's record, the SDK's device copy, the
    memory store) loads no Ray or Redis."""
    loaded = _modules_after(
        "import vitserve.encoder.engine\n"
        "import vitserve.deployments.encoder.records\n"
        "import vitserve.client.device\n"
        "from vitserve.cache.urls import open_store\n"
        "open_store('memory://', namespace='').close()\n"
    )
    assert {"torch", "numpy"} <= loaded  # else the check would be vacuous
    assert not loaded & {"ray", "redis"}


@pytest.mark.parametrize(
    "module",
    [
        "vitserve.keys",
        "vitserve.encoder.planner",
        "vitserve.encoder.images",
        "vitserve.encoder.decode_work",
        "vitserve.client.ec_config",
        "vitserve",
        # the rooms that promise it (their docstrings; room_violations checks their statements)
        "vitserve.deployments.common.serving",
        "vitserve.deployments.common.clients",
        "vitserve.deployments.vllm.app",
    ],
)
def test_light_modules_do_not_import_torch(module: str) -> None:
    assert "torch" not in _modules_after_import(module)


def test_cache_never_imports_torch_or_transformers(redis_url) -> None:
    """A whole store round trip (codec, memory, Redis, tiered, URLs) loads neither."""
    loaded = _modules_after(
        "from vitserve.cache import open_store, tiered_url\n"
        "from vitserve.testing.records import make_record\n"
        "import vitserve.cache.node\n"
        f"store = open_store(tiered_url('memory://', {redis_url!r}, namespace='layering'))\n"
        "record = make_record()\n"
        "store.put_many([record])\n"
        "assert store.get(record.key) is not None\n"
    )
    assert {"redis", "msgpack", "numpy"} <= loaded
    assert not loaded & {"torch", "transformers"}


def test_family_specs_and_the_client_adapters_load_no_torch() -> None:
    """The light client reads every family's spec (and builds prompt layouts, vLLM forms and
    mrope positions from it) without torch or transformers."""
    loaded = _modules_after(
        "import vitserve.families\n"
        "import vitserve.client.adapters\n"
        "assert len(vitserve.families.SPECS) >= 5\n"
    )
    assert "numpy" in loaded  # the adapters' own dependency: the import ran
    assert not loaded & {"torch", "transformers"}


def test_cli_starts_without_torch() -> None:
    assert "torch" not in _modules_after_import("vitserve.deployments.runner.cli")


def test_wheel_maps_top_level_folders_to_subpackages(tmp_path) -> None:
    """A plain (non-editable) build ships encoder/ as vitserve/encoder/ etc., and the script."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("vitserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "vitserve/__init__.py",
        "vitserve/errors.py",
        "vitserve/encoder/engine.py",
        "vitserve/encoder/towers/qwen.py",
        "vitserve/families/llava.py",
        "vitserve/testing/models.py",
        "vitserve/cache/__init__.py",
        "vitserve/client/__init__.py",
        "vitserve/deployments/runner/cli.py",
        "vitserve/cli.py",
    ):
        assert path in names, path
    assert not any(n.startswith(("tests/", "encoder/", "loadtest/")) for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-8:]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vitserve = vitserve.cli:main" in text


# -- the rooms of vitserve.deployments ----------------------------------------------------------
# Each room's package docstring states what it may import; these are those rules, checked on
# every import statement of every module (at the top or inside a function).
DEPLOYMENTS = "vitserve.deployments"
ROOMS = ("common", "encoder", "prefill", "vllm", "runner")
#: room -> the other rooms it may import (every room may import itself)
MAY_IMPORT = {
    "common": set(),
    "encoder": {"common"},
    "prefill": {"common"},
    "vllm": {"common"},
    "runner": {"common", "encoder", "prefill", "vllm"},
}
#: (module, modules it must not import): what crosses a process inside a room goes through a
#: module both sides import, never one side's own module
APART = [
    ("encoder.ingress", "encoder.replica"),
    ("encoder.encode_flow", "encoder.replica"),
    ("encoder.ingress", "encoder.preprocessing.PreprocessDeployment"),
    ("encoder.preprocessing", "encoder.replica"),
    ("encoder.replica", "encoder.ingress"),
    ("encoder.replica", "encoder.encode_flow"),
    # the replica is the Serve shell: it reaches the encode path's parts through the pipeline
    ("encoder.replica", "encoder.single_flight"),
    ("encoder.replica", "encoder.flight_store"),
    ("encoder.replica", "encoder.publisher"),
    ("encoder.replica", "encoder.device_queue"),
    ("encoder.replica", "encoder.admission"),
]
#: module -> all it may import: the flight plan is pure state (no thread, store call or clock)
PURE = {
    "encoder.single_flight": {
        "__future__",
        "asyncio",
        "enum",
        "collections",
        "dataclasses",
        "typing",
        "vitserve.cache.base",
    },
}
#: rooms that never import torch or transformers, not even inside a function
LIGHT_ROOMS = {"common": {"torch", "transformers"}, "vllm": {"torch", "transformers"}}


def _imports(source: str, module: str) -> list[str]:
    """Every name ``source`` (the module ``module``) imports, absolute, with the imported names
    appended (``from a.b import c`` gives ``a.b.c``)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                package = module.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            out += [f"{base}.{alias.name}" for alias in node.names]
    return out


def room_violations(module: str, source: str) -> list[str]:
    """The rules of the rooms that ``source``, the module ``module``
    (``vitserve.deployments.<room>.<name>``), breaks; empty when it keeps them all."""
    parts = module.split(".")
    if parts[:2] != ["vitserve", "deployments"] or len(parts) < 4 or parts[2] not in ROOMS:
        return []
    room, here = parts[2], ".".join(parts[2:])
    found = []
    for name in _imports(source, module):
        top = name.split(".")[0]
        if room in LIGHT_ROOMS and top in LIGHT_ROOMS[room]:
            found.append(f"{module} imports {name}: the {room} room never imports {top}")
        if not name.startswith(DEPLOYMENTS + "."):
            continue
        target = name[len(DEPLOYMENTS) + 1 :]
        other = target.split(".")[0]
        if other in ROOMS and other != room and other not in MAY_IMPORT[room]:
            found.append(
                f"{module} imports {name}: the {room} room may not import the {other} room"
            )
        for a, b in APART:
            if here == a and (target == b or target.startswith(b + ".")):
                found.append(f"{module} imports {name}: {a} and {b} meet in a shared module")
    for name in _imports(source, module) if here in PURE else []:
        if not any(name == ok or name.startswith(ok + ".") for ok in PURE[here]):
            found.append(f"{module} imports {name}: {here} is pure state")
    return found


def _deployment_modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / "deployments").rglob("*.py")):
        rel = path.relative_to(ROOT / "deployments").with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out.append((".".join([DEPLOYMENTS, *parts]), path))
    return out


def test_every_deployments_module_lives_in_a_room() -> None:
    """No module sits beside the rooms (only the package's own __init__)."""
    loose = [
        m for m, _ in _deployment_modules() if m != DEPLOYMENTS and m.split(".")[2] not in ROOMS
    ]
    assert loose == []
    assert {m.split(".")[2] for m, _ in _deployment_modules() if m != DEPLOYMENTS} == set(ROOMS)


def test_the_rooms_keep_their_import_rules() -> None:
    """Every module of every room keeps the rules its room's docstring states."""
    modules = _deployment_modules()
    assert len(modules) > 20  # else the check would be vacuous
    broken = [v for module, path in modules for v in room_violations(module, path.read_text())]
    assert broken == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("vitserve.deployments.common.config", "from vitserve.deployments.encoder import app"),
        ("vitserve.deployments.common.auth", "import vitserve.deployments.runner.cli"),
        ("vitserve.deployments.encoder.replica", "from vitserve.deployments.prefill.chat import X"),
        ("vitserve.deployments.prefill.app", "from vitserve.deployments.encoder.app import x"),
        ("vitserve.deployments.prefill.chat", "from ..vllm import app"),
        ("vitserve.deployments.vllm.app", "from vitserve.deployments.prefill.app import T"),
        ("vitserve.deployments.vllm.app", "def f():\n    import torch\n"),
        ("vitserve.deployments.common.metrics", "from transformers import AutoConfig"),
        (
            "vitserve.deployments.encoder.ingress",
            "from vitserve.deployments.encoder.replica import y",
        ),
        ("vitserve.deployments.encoder.encode_flow", "from .replica import EncodeBatch"),
        ("vitserve.deployments.encoder.replica", "from .single_flight import SingleFlight"),
        ("vitserve.deployments.encoder.replica", "from .publisher import Publisher"),
        ("vitserve.deployments.encoder.single_flight", "import time"),
        ("vitserve.deployments.encoder.single_flight", "from concurrent.futures import Future"),
        ("vitserve.deployments.encoder.single_flight", "from vitserve.errors import StoreError"),
        ("vitserve.deployments.encoder.app", "from vitserve.deployments.runner.local import z"),
    ],
)
def test_each_room_rule_fails_when_broken(module: str, source: str) -> None:
    assert room_violations(module, source), f"{module}: {source!r} went unnoticed"


def test_a_room_may_import_what_its_rules_allow() -> None:
    allowed = [
        ("vitserve.deployments.encoder.replica", "from vitserve.deployments.common import metrics"),
        ("vitserve.deployments.runner.local", "from vitserve.deployments.prefill.app import a"),
        ("vitserve.deployments.encoder.ingress", "from .wire import describe_header"),
        ("vitserve.deployments.encoder.replica", "from .pipeline import EncodePipeline"),
        ("vitserve.deployments.encoder.single_flight", "from collections.abc import Mapping"),
        ("vitserve.deployments.prefill.chat_service", "import torch"),
    ]
    assert [v for m, s in allowed for v in room_violations(m, s)] == []


# -- no import cycles ---------------------------------------------------------------------------
# Every product module's imports, at the top or inside a function, as a graph of vitserve's own
# modules: a cycle is a knot (a module that cannot be read, tested or replaced without the
# other), even where a lazy import keeps it from failing at start.
PRODUCT = {"cache": "vitserve.cache", "client": "vitserve.client", "encoder": "vitserve.encoder"}
PRODUCT |= {"deployments": DEPLOYMENTS, "vitserve": "vitserve"}


def product_modules() -> dict[str, Path]:
    out = {}
    for folder, package in PRODUCT.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts]
            parts = [p for p in parts if p != "__init__"]
            if folder == "vitserve" and parts and parts[0] in PRODUCT:
                continue  # the links of the development tree, if any
            out[".".join([package, *parts])] = path
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` (module -> (source, is a package)) it imports."""
    graph: dict[str, set[str]] = {}
    for module, (source, package) in sources.items():
        deps = set()
        here = module if package else module.rpartition(".")[0]
        for name in _imports(source, here + ".x"):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_product_code_has_no_import_cycle() -> None:
    modules = product_modules()
    assert len(modules) > 80  # else the check would be vacuous
    sources = {m: (p.read_text(), p.name == "__init__.py") for m, p in modules.items()}
    assert cycles(import_graph(sources)) == []


def test_an_import_cycle_is_found_even_inside_a_function() -> None:
    sources = {
        "vitserve.cache": ("", True),
        "vitserve.cache.urls": ("def f():\n    from vitserve.cache.redis_store import S\n", False),
        "vitserve.cache.redis_store": ("from vitserve.cache.urls import redact_url\n", False),
        "vitserve.cache.redaction": ("", False),
    }
    assert cycles(import_graph(sources)) == [["vitserve.cache.redis_store", "vitserve.cache.urls"]]
    sources["vitserve.cache.redis_store"] = ("from .redaction import redact_url\n", False)
    assert cycles(import_graph(sources)) == []


# -- vitserve.testing: the test helpers that ship ------------------------------------------------
# The random-weight test models, synthetic images and test records that the command line, the
# demo and the benchmarks use are one package, vitserve.testing; what only the tests use lives in
# tests/. Product code imports vitserve.testing only where it builds test models or runs the
# demo; the encoder, the stores and the SDK never load it; no product package keeps test helpers
# of its own; and nothing ships that imports the tests.
TESTING = "vitserve.testing"
#: the product modules that may import vitserve.testing (besides its own): the CLI
#: (``make-model``), the demo, and the builder of the ``demo`` model (``resolve_model``)
MAY_IMPORT_TESTING = {
    "vitserve.deployments.runner.cli",
    "vitserve.deployments.runner.demo",
    "vitserve.deployments.common.serving",
}


def _in_testing(name: str) -> bool:
    return name == TESTING or name.startswith(TESTING + ".")


def helper_violations(module: str, source: str, *, package: bool = False) -> list[str]:
    """The test-helper rules that ``source``, the product module ``module`` (a package's
    ``__init__`` when ``package``), breaks at the top or inside a function: it imports
    vitserve.testing and is neither of it nor of :data:`MAY_IMPORT_TESTING`, or it imports
    ``tests``."""
    found = []
    for name in _imports(source, f"{module}.x" if package else module):
        if name.split(".")[0] == "tests":
            found.append(f"{module} imports {name}: the tests' helpers do not ship")
        elif _in_testing(name) and not (_in_testing(module) or module in MAY_IMPORT_TESTING):
            found.append(f"{module} imports {name}: only {sorted(MAY_IMPORT_TESTING)} may")
    return found


def misplaced_test_modules(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` named as test code (a part starting with ``test``:
    ``testing``, ``testmodels``, ``test_utils``) outside vitserve.testing."""
    return sorted(
        m for m in modules if not _in_testing(m) and any(p.startswith("test") for p in m.split("."))
    )


def test_only_the_cli_and_the_demo_import_the_test_helpers() -> None:
    """Every product module keeps the rules (:func:`helper_violations`), and
    :data:`MAY_IMPORT_TESTING` names only modules that do import vitserve.testing."""
    modules = product_modules()
    assert len(modules) > 80  # else the check would be vacuous
    sources = {m: (p.read_text(), p.name == "__init__.py") for m, p in modules.items()}
    broken = [v for m, (s, pkg) in sources.items() for v in helper_violations(m, s, package=pkg)]
    assert broken == []
    importers = {
        m
        for m, (s, pkg) in sources.items()
        if not _in_testing(m) and any(map(_in_testing, _imports(s, f"{m}.x" if pkg else m)))
    }
    assert importers == MAY_IMPORT_TESTING


@pytest.mark.parametrize(
    ("module", "source", "package"),
    [
        ("vitserve.encoder.engine", "from vitserve.testing.images import make_image", False),
        ("vitserve.cache.memory", "def f():\n    from vitserve.testing import records\n", False),
        ("vitserve.client.sync", "import vitserve.testing.models", False),
        ("vitserve.deployments.encoder.replica", "from vitserve.testing.models import m", False),
        ("vitserve.deployments.runner.local", "from vitserve.testing import images", False),
        ("vitserve.cli", "from .testing import models", False),
        ("vitserve.encoder", "from ..testing import images", True),
        ("vitserve.deployments.runner.demo", "from tests.image_inputs import bad_images", False),
        ("vitserve.testing.models", "import tests.full_model", False),
    ],
)
def test_each_test_helper_rule_fails_when_broken(module: str, source: str, package: bool) -> None:
    assert helper_violations(module, source, package=package), f"{module}: {source!r}"


def test_the_cli_the_demo_and_the_helpers_themselves_may_import_them() -> None:
    allowed = [
        ("vitserve.deployments.runner.cli", "from vitserve.testing.models import m", False),
        ("vitserve.deployments.common.serving", "def f():\n    import vitserve.testing\n", False),
        ("vitserve.testing.images", "from vitserve.testing import models", False),
        ("vitserve.testing", "from . import records", True),
    ]
    assert [v for m, s, p in allowed for v in helper_violations(m, s, package=p)] == []


def test_the_encoder_stores_and_sdk_load_no_test_helpers() -> None:
    """Every module of vitserve.encoder, vitserve.cache and vitserve.client, imported in one
    fresh interpreter (but one whose optional library, vLLM, is missing), loads nothing of
    vitserve.testing, directly or through another module."""
    modules = sorted(
        m for m in product_modules() if m.split(".")[:2][-1] in ("encoder", "cache", "client")
    )
    loaded = _all_modules_after(
        "import importlib\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:  # an optional library (vllm), not vitserve's own\n"
        "        if (e.name or 'vitserve').split('.')[0] == 'vitserve':\n"
        "            raise\n"
    )
    assert {"vitserve.encoder.engine", "vitserve.cache.tiered", "vitserve.client.sync"} <= loaded
    assert sorted(filter(_in_testing, loaded)) == []


def test_no_product_package_keeps_test_modules_beside_vitserve_testing() -> None:
    modules = product_modules()
    assert {TESTING, f"{TESTING}.models", f"{TESTING}.images"} <= set(modules)  # not vacuous
    assert misplaced_test_modules(modules) == []


@pytest.mark.parametrize(
    "module",
    [
        "vitserve.encoder.testmodels",
        "vitserve.encoder.testimages",
        "vitserve.cache.testing",
        "vitserve.client.test_utils",
        "vitserve.deployments.runner.testing.fakes",
        "vitserve.testing_helpers",
    ],
)
def test_a_test_module_in_a_product_package_is_found(module: str) -> None:
    assert misplaced_test_modules([module, TESTING, f"{TESTING}.records"]) == [module]


# -- stores open from a table -------------------------------------------------------------------
# cache/urls.py keeps the table scheme -> backend module (BACKENDS) and imports a backend only
# through it, when a URL of its scheme is opened; each backend module declares what it serves
# (its BACKEND: schemes, options, from_url). The Redis ACL rules are pure (cache/redis_acl.py).
URLS = "vitserve.cache.urls"


def _url_table() -> dict[str, str]:
    from vitserve.cache.urls import BACKENDS

    return BACKENDS


def backend_imports(source: str) -> list[str]:
    """What ``source`` (the module vitserve.cache.urls) imports of the table's backend modules,
    at the top or inside a function."""
    backends = set(_url_table().values())
    return sorted(
        name
        for name in _imports(source, URLS)
        if any(name == b or name.startswith(b + ".") for b in backends)
    )


def test_the_url_table_imports_no_backend_but_through_the_table() -> None:
    """No import statement of urls.py names a backend, and importing it loads none (nor Ray or
    redis-py): each is imported by its row of the table, when a URL of its scheme is opened."""
    assert backend_imports((ROOT / "cache" / "urls.py").read_text()) == []
    loaded = _all_modules_after(f"import {URLS}")
    assert URLS in loaded  # else the check would be vacuous
    backends = set(_url_table().values())
    assert sorted(m for m in loaded if m in backends or m.split(".")[0] in ("ray", "redis")) == []


@pytest.mark.parametrize(
    "source",
    [
        "from vitserve.cache.redis_store import RedisConnection\n",
        "def f():\n    from vitserve.cache.node import NodeConnection\n",
        "import vitserve.cache.memory\n",
        "from .tiered import TieredConnection\n",
    ],
)
def test_a_backend_imported_by_the_url_table_is_found(source: str) -> None:
    assert backend_imports(source), source


def test_each_backend_declares_exactly_the_schemes_the_table_gives_it() -> None:
    """Every module of the table declares a BACKEND whose schemes are its rows (no more, no
    fewer, none twice), and every module of cache/ that declares a BACKEND has rows."""
    import importlib

    table = _url_table()
    modules = sorted(set(table.values()))
    assert len(modules) >= 5  # memory, node, redis, redis cluster, tiered
    for module in modules:
        schemes = importlib.import_module(module).BACKEND.schemes
        assert sorted(schemes) == sorted(s for s, m in table.items() if m == module), module
    cache = (ROOT / "cache").glob("*.py")
    declaring = {f"vitserve.cache.{p.stem}" for p in cache if declares_backend(p.read_text())}
    assert declaring == set(modules)


def declares_backend(source: str) -> bool:
    """Whether ``source`` assigns ``BACKEND`` at its top level."""
    import ast

    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "BACKEND" for t in targets):
            return True
    return False


def test_the_redis_acl_rules_import_no_redis_client() -> None:
    """cache/redis_acl.py builds rules from the standard library alone: the CLI and the auth
    config write users without redis-py."""
    source = (ROOT / "cache" / "redis_acl.py").read_text()
    imported = {name.split(".")[0] for name in _imports(source, "vitserve.cache.redis_acl")}
    assert imported <= set(sys.stdlib_module_names), imported
    loaded = _modules_after("from vitserve.cache.redis_acl import writer_acl\nwriter_acl()\n")
    assert "vitserve" in loaded and "redis" not in loaded
