"""No pickle anywhere in vitserve's own code: nothing that crosses a process or a store (records,
headers, HTTP bodies, row reads, handle payloads vitserve builds) is pickled or unpickled.

An AST scan of every ``.py`` under the packages (cache/, client/, deployments/, encoder/,
vitserve/) refuses: importing pickle, cPickle/_pickle, cloudpickle, dill, marshal, shelve,
joblib or ray.cloudpickle (also through ``from ... import`` and ``importlib.import_module``);
``torch.load`` however reached (``import torch as t``, ``from torch import load``);
``read_pickle``/``to_pickle``; and any call with ``allow_pickle`` not literally False
(``numpy.load``, ``numpy.save``). A planted sample shows the scanner catches each form.

Out of scope, and said so: Ray's own serialization of deployment-handle arguments and results
(Ray pickles what a ``.remote()`` call carries; vitserve hands it bytes, numpy arrays and plain
dicts, never its own pickles), and how transformers reads a checkpoint (vitserve's loaders read
safetensors).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache", "client", "deployments", "encoder", "vitserve")
FORBIDDEN_MODULES = (
    "pickle",
    "cPickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "joblib",
    "ray.cloudpickle",
    "torch.serialization",
)
FORBIDDEN_NAMES = ("torch.load",)  # dotted names, after resolving import aliases
FORBIDDEN_ATTRIBUTES = ("read_pickle", "to_pickle")  # pandas and the like, on any object


def _forbidden_module(dotted: str) -> str | None:
    for module in FORBIDDEN_MODULES:
        if dotted == module or dotted.startswith(module + "."):
            return module
    for name in FORBIDDEN_NAMES:
        if dotted == name or dotted.startswith(name + "."):
            return name
    return None


class _Scanner(ast.NodeVisitor):
    """Collects ``(line, what)`` for every forbidden use in one module."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it stands for
        self.found: list[tuple[int, str]] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if hit := _forbidden_module(alias.name):
                self._flag(node, f"import {hit}")
            local = alias.asname or alias.name.split(".")[0]
            self.aliases[local] = alias.name if alias.asname else alias.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        for alias in node.names:
            dotted = f"{base}.{alias.name}" if base else alias.name
            if hit := _forbidden_module(base) or _forbidden_module(dotted):
                self._flag(node, f"from {base} import {alias.name} ({hit})")
            self.aliases[alias.asname or alias.name] = dotted

    def _dotted(self, node: ast.AST) -> str | None:
        """``a.b.c`` with ``a`` resolved through the module's imports; None if not a name."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if dotted and (hit := _forbidden_module(dotted)):
            self._flag(node, f"{dotted} ({hit})")
        elif node.attr in FORBIDDEN_ATTRIBUTES:
            self._flag(node, f".{node.attr}")
        else:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        dotted = self.aliases.get(node.id)
        if dotted and (hit := _forbidden_module(dotted)) and hit in FORBIDDEN_NAMES:
            self._flag(node, f"{node.id} = {dotted}")

    def visit_Call(self, node: ast.Call) -> None:
        for keyword in node.keywords:
            value = keyword.value
            if keyword.arg == "allow_pickle" and not (
                isinstance(value, ast.Constant) and value.value is False
            ):
                self._flag(node, "allow_pickle not False")
        target = self._dotted(node.func)
        if target in ("importlib.import_module", "__import__") and node.args:
            first = node.args[0]
            named = first.value if isinstance(first, ast.Constant) else None
            if isinstance(named, str) and (hit := _forbidden_module(named)):
                self._flag(node, f"{target}({named!r}) ({hit})")
        self.generic_visit(node)


def scan_source(source: str, filename: str = "<sample>") -> list[tuple[int, str]]:
    scanner = _Scanner()
    scanner.visit(ast.parse(source, filename))
    return sorted(set(scanner.found))


def _package_files() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    return [p for p in files if ".venv" not in p.parts and "__pycache__" not in p.parts]


def test_no_pickle_in_the_packages() -> None:
    files = _package_files()
    assert len(files) > 40 and {p.relative_to(ROOT).parts[0] for p in files} == set(PACKAGES)
    found = {
        str(p.relative_to(ROOT)): hits
        for p in files
        if (hits := scan_source(p.read_text(encoding="utf-8"), str(p)))
    }
    assert found == {}


PLANTED = {
    "import pickle": "import pickle",
    "import cPickle as cp": "import cPickle",
    "import _pickle": "import _pickle",
    "from cloudpickle import dumps": "cloudpickle",
    "import dill": "import dill",
    "import marshal": "import marshal",
    "import shelve": "import shelve",
    "from joblib import load": "joblib",
    "import ray.cloudpickle": "import ray.cloudpickle",
    "from ray import cloudpickle": "ray.cloudpickle",
    "import ray\nray.cloudpickle.loads(b'')": "ray.cloudpickle",
    "import torch\ntorch.load('x.pt')": "torch.load",
    "import torch as t\nt.load(f, weights_only=True)": "torch.load",
    "from torch import load\nload('x.pt')": "torch.load",
    "from torch import load as tl\ntl('x.pt')": "torch.load",
    "import torch.serialization": "torch.serialization",
    "import numpy as np\nnp.load('a.npy', allow_pickle=True)": "allow_pickle",
    "import numpy as np\nnp.save('a.npy', a, allow_pickle=flag)": "allow_pickle",
    "import pandas as pd\npd.read_pickle('x')": ".read_pickle",
    "import importlib\nimportlib.import_module('pickle')": "import_module('pickle')",
    "__import__('dill')": "__import__('dill')",
}


@pytest.mark.parametrize("source", list(PLANTED))
def test_scanner_catches_a_planted_sample(source: str) -> None:
    hits = scan_source(source)
    assert hits and any(PLANTED[source] in what for _, what in hits), hits


def test_scanner_passes_what_is_allowed() -> None:
    clean = (
        "import numpy as np\nimport msgpack\nimport torch\n"
        "from safetensors.torch import load_file\n"
        "a = np.load('a.npy')\nb = np.load('a.npy', allow_pickle=False)\n"
        "w = load_file('m.safetensors')\nt = torch.zeros(3)\n"
        "h = msgpack.unpackb(b'\\x80')\nmodel.load_state_dict(w)\n"
    )
    assert scan_source(clean) == []
