"""The shape of a checkout's product code, read from its source (``ast``; nothing is imported):
its largest classes (lines, methods, distinct ``self.X`` attributes), its largest functions and
methods, its files over 500 lines, and the import cycles among its modules.

Product code is the folders of pyproject.toml's ``[tool.setuptools.package-dir]`` (``vitserve``,
``encoder``, ``cache``, ``client``, ``deployments``: ``PACKAGE_DIRS`` when the checkout's
pyproject cannot be read). A module's imports are every ``import`` and ``from ... import``
statement in it, at the top or inside a function, resolved to the product modules they name
(``from vitserve.cache import open_store`` is an edge to ``vitserve.cache``); a cycle is a
strongly connected component of more than one module (tests/test_layering.py asserts none).

    .venv/bin/python loadtest/code_shape.py                  # this checkout
    .venv/bin/python loadtest/code_shape.py --repo /tmp/before --top 20
    .venv/bin/python loadtest/code_shape.py --before /tmp/before --after . --out shape.md

Invariants:

* A class's or function's lines are ``end_lineno - lineno + 1`` (decorators not counted). A def
  nested in a function is part of that function, never a row of its own; a class nested in a
  class is a row of its own (``Outer.Inner``), and so are its methods.
* A class's methods are the defs directly in its body; its attributes are the distinct ``X`` of
  ``self.X = ...`` (also ``+=``, annotated and unpacking assignments) anywhere in its body
  outside a nested class.
* The report is a function of the source alone: the same tree gives the same page (ties are
  ordered by name).
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
#: folder -> package, as pyproject.toml maps them (used when it cannot be read)
PACKAGE_DIRS = {
    "vitserve": "vitserve",
    "encoder": "vitserve.encoder",
    "cache": "vitserve.cache",
    "client": "vitserve.client",
    "deployments": "vitserve.deployments",
}
LONG_FILE = 500  # lines


@dataclass(frozen=True)
class ClassRow:
    where: str  # path:Class
    lines: int
    methods: int
    attributes: int


@dataclass(frozen=True)
class Shape:
    files: int
    lines: int
    classes: list[ClassRow]  # largest first
    functions: list[tuple[str, int]]  # (path:Class.method, lines), largest first
    long_files: list[tuple[str, int]]  # (path, lines) over LONG_FILE, largest first
    cycles: list[list[str]]  # each sorted, the list sorted


# -- the modules -----------------------------------------------------------------------------------
def package_dirs(repo: Path) -> dict[str, str]:
    """folder -> package: the checkout's ``[tool.setuptools.package-dir]``, else PACKAGE_DIRS."""
    pyproject = repo / "pyproject.toml"
    if tomllib is None or not pyproject.is_file():
        return dict(PACKAGE_DIRS)
    table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    mapping = {folder: package for package, folder in table.get("package-dir", {}).items()}
    return mapping or dict(PACKAGE_DIRS)


def product_modules(repo: Path) -> dict[str, Path]:
    """module name -> file, for every .py file of the product folders."""
    dirs = package_dirs(repo)
    out: dict[str, Path] = {}
    for folder, package in dirs.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(repo / folder).with_suffix("").parts]
            module = ".".join([package, *(p for p in parts if p != "__init__")])
            # a link of the development tree (vitserve/encoder -> ../encoder): another folder's
            if any(
                other != folder and (module == pkg or module.startswith(pkg + "."))
                for other, pkg in dirs.items()
                if len(pkg) > len(package)
            ):
                continue
            out[module] = path
    return out


def imports(source: str, module: str, package: bool) -> list[str]:
    """Every name the module imports, absolute, imported names appended (``from a.b import c``
    gives ``a.b.c``); relative imports resolved against the module's package."""
    here = module if package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{parent}.{base}" if base else parent
            out += [f"{base}.{alias.name}" for alias in node.names]
    return out


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` (module -> (source, is a package)) it imports."""
    graph: dict[str, set[str]] = {}
    for module, (source, package) in sources.items():
        deps = set()
        for name in imports(source, module, package):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: the modules each reaches
    that reach it back (a few hundred modules: plain reachability is enough)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = {start}, [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        reach[start] = seen
    found, done = [], set()
    for module in sorted(graph):
        if module not in done:
            component = sorted(m for m in reach[module] if module in reach.get(m, ()))
            done.update(component)
            if len(component) > 1:
                found.append(component)
    return found


# -- classes and functions -------------------------------------------------------------------------
DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _self_attributes(node: ast.AST) -> set[str]:
    """The X of every ``self.X = ...`` under ``node``, not looking into nested classes."""
    found = set()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            continue
        if isinstance(child, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = child.targets if isinstance(child, ast.Assign) else [child.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                        and isinstance(sub.ctx, ast.Store)
                    ):
                        found.add(sub.attr)
        found |= _self_attributes(child)
    return found


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def definitions(tree: ast.AST, path: str) -> tuple[list[ClassRow], list[tuple[str, int]]]:
    """The classes and the functions/methods (nested defs not apart) of one module."""
    classes: list[ClassRow] = []
    functions: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, DEFS):
                functions.append((f"{path}:{prefix}{child.name}", _span(child)))
            elif isinstance(child, ast.ClassDef):
                methods = sum(isinstance(s, DEFS) for s in child.body)
                attrs = len(_self_attributes(child))
                name = f"{prefix}{child.name}"
                classes.append(ClassRow(f"{path}:{name}", _span(child), methods, attrs))
                visit(child, f"{name}.")
            elif isinstance(child, ast.stmt):  # if TYPE_CHECKING:, try:, with: ...
                visit(child, prefix)

    visit(tree, "")
    return classes, functions


def measure(repo: Path, top: int = 10) -> Shape:
    """The figures of the checkout at ``repo``."""
    modules = product_modules(repo)
    classes: list[ClassRow] = []
    functions: list[tuple[str, int]] = []
    long_files: list[tuple[str, int]] = []
    sources: dict[str, tuple[str, bool]] = {}
    total = 0
    for module, file in modules.items():
        source = file.read_text()
        path = file.relative_to(repo).as_posix()
        sources[module] = (source, file.name == "__init__.py")
        lines = len(source.splitlines())
        total += lines
        if lines > LONG_FILE:
            long_files.append((path, lines))
        found_classes, found_functions = definitions(ast.parse(source), path)
        classes += found_classes
        functions += found_functions
    classes.sort(key=lambda c: (-c.lines, c.where))
    functions.sort(key=lambda f: (-f[1], f[0]))
    long_files.sort(key=lambda f: (-f[1], f[0]))
    return Shape(
        files=len(modules),
        lines=total,
        classes=classes[:top],
        functions=functions[:top],
        long_files=long_files,
        cycles=cycles(import_graph(sources)),
    )


# -- the page --------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _summary(shape: Shape) -> list[int]:
    return [shape.files, shape.lines, len(shape.long_files), len(shape.cycles)]


SUMMARY = ["product files", "product lines", f"files over {LONG_FILE} lines", "import cycles"]


def _class_cells(row: ClassRow | None) -> list[object]:
    return [f"`{row.where}`", row.lines, row.methods, row.attributes] if row else ["", "", "", ""]


def _pair_cells(row: tuple[str, int] | None) -> list[object]:
    return [f"`{row[0]}`", row[1]] if row else ["", ""]


def _cycle_lines(shape: Shape) -> list[str]:
    return [f"- {' <-> '.join(f'`{m}`' for m in c)}" for c in shape.cycles] or ["- none"]


def render(shape: Shape, title: str) -> str:
    """One checkout's page."""
    out = [f"# Code shape: {title}", ""]
    out += _table(
        ["figure", "value"], [[n, v] for n, v in zip(SUMMARY, _summary(shape), strict=True)]
    )
    out += ["", f"## The {len(shape.classes)} largest classes", ""]
    head = ["#", "class", "lines", "methods", "self attributes"]
    out += _table(head, [[i, *_class_cells(c)] for i, c in enumerate(shape.classes, 1)])
    out += ["", f"## The {len(shape.functions)} largest functions and methods", ""]
    rows = [[i, *_pair_cells(f)] for i, f in enumerate(shape.functions, 1)]
    out += _table(["#", "function", "lines"], rows)
    out += ["", f"## Files over {LONG_FILE} lines: {len(shape.long_files)}", ""]
    rows = [[i, *_pair_cells(f)] for i, f in enumerate(shape.long_files, 1)]
    out += _table(["#", "file", "lines"], rows)
    out += ["", f"## Import cycles: {len(shape.cycles)}", "", *_cycle_lines(shape)]
    return "\n".join(out) + "\n"


def render_pair(before: Shape, after: Shape, names: tuple[str, str]) -> str:
    """Two checkouts' figures side by side (rank by rank)."""
    b, a = names
    out = [f"# Code shape: {b} vs {a}", ""]
    rows = [
        [n, x, y, f"{y - x:+d}"]
        for n, x, y in zip(SUMMARY, _summary(before), _summary(after), strict=True)
    ]
    out += _table(["figure", b, a, "change"], rows)

    out += ["", "## The largest classes", ""]
    head = ["#"] + [c for n in (b, a) for c in (f"{n}: class", "lines", "methods", "attrs")]
    pairs = enumerate(zip_longest(before.classes, after.classes), 1)
    out += _table(head, [[i, *_class_cells(x), *_class_cells(y)] for i, (x, y) in pairs])
    for title, left, right, what in (
        ("The largest functions and methods", before.functions, after.functions, "function"),
        (f"Files over {LONG_FILE} lines", before.long_files, after.long_files, "file"),
    ):
        out += ["", f"## {title}", ""]
        head = ["#", f"{b}: {what}", "lines", f"{a}: {what}", "lines"]
        rows = [
            [i, *_pair_cells(x), *_pair_cells(y)]
            for i, (x, y) in enumerate(zip_longest(left, right), 1)
        ]
        out += _table(head, rows)
    out += ["", "## Import cycles", "", f"{b}: {len(before.cycles)}", "", *_cycle_lines(before)]
    out += ["", f"{a}: {len(after.cycles)}", "", *_cycle_lines(after)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout (default: this)")
    parser.add_argument("--before", type=Path, help="with --after: two checkouts side by side")
    parser.add_argument("--after", type=Path)
    parser.add_argument("--top", type=int, default=10, help="rows of the largest-N tables")
    parser.add_argument("--out", type=Path, help="write the page here (else print it)")
    args = parser.parse_args(argv)
    if (args.before is None) != (args.after is None):
        parser.error("--before and --after go together")
    if args.before is not None:
        names = (str(args.before), str(args.after))
        page = render_pair(measure(args.before, args.top), measure(args.after, args.top), names)
    else:
        page = render(measure(args.repo, args.top), str(args.repo))
    if args.out:
        args.out.write_text(page)
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
