"""The lowest versions pyproject.toml's lower bounds allow, as pip constraints for `make
test-min-versions`.

pyproject.toml says ``ray[serve]>=2.60``: a claim that vitserve works with Ray 2.60.0. The
minimum-versions job checks it literally: each ``>=`` bound of the base dependencies and of the
chosen extras (``server``) becomes an exact pin, ``ray==2.60``, and pip installs the project
under those pins (``pip install -c PINS -e '.[server,dev]'``). A bound that is a lie fails the
install or the tests, by name, instead of a resolver quietly taking a higher version (what
``uv pip install --resolution lowest-direct`` does when the lowest conflicts, and it would
also take every dev tool at its lowest). What the bounds leave free floats: the transitive
dependencies, the dev tools (pytest, ruff, ...) and the packages given with ``--float``
(torch: the build lying on this machine, see the Makefile's TORCH).

    python3 -m tests.min_versions --extra server --float torch > build/min-venv/pins.txt

Standard library only (tomllib: Python 3.11+), run before the venv exists.

Invariants:
- One pin per package that a requirement of the base list or a chosen extra bounds from below
  (``>=``), at exactly that bound; extras and environment markers are dropped from the pin
  (pip constraints take neither), the package name is kept as pyproject spells it.
- A requirement without a ``>=`` bound gets no pin (it floats), and is named on stderr.
- A package bounded twice (the base list and an extra) is pinned at the higher bound.
- ``--float NAME`` leaves that package unpinned (named on stderr); naming one that pyproject
  does not bound is an error (exit 2), so a stale name cannot hide.
- The output is the same for the same pyproject: pins sorted by normalized name.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

# name[extras] (spec, spec) ; marker -- the subset of PEP 508 pyproject.toml uses
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")
_LOWER = re.compile(r">=\s*([0-9][A-Za-z0-9.+!-]*)")


def normalize(name: str) -> str:
    """PEP 503's normalized name: ``typing_extensions`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0]))


def lower_bounds(requirements: Iterable[str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """(normalized name -> (name as spelled, lowest version), requirements with no ``>=``)."""
    bounds: dict[str, tuple[str, str]] = {}
    unbounded: list[str] = []
    for text in requirements:
        match = _REQUIREMENT.match(text)
        if not match:
            raise ValueError(f"not a requirement this script reads: {text!r}")
        name, specs = match[1], match[3]
        lower = _LOWER.search(specs)
        if not lower:
            unbounded.append(text)
            continue
        key = normalize(name)
        if key not in bounds or _version_key(lower[1]) > _version_key(bounds[key][1]):
            bounds[key] = (name, lower[1])
    return bounds, unbounded


def pins(
    project: dict, extras: Sequence[str], floating: Sequence[str]
) -> tuple[list[str], list[str]]:
    """(the pin lines, the notes for stderr) for the ``[project]`` table ``project``."""
    requirements = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"pyproject.toml has no extra {extra!r}")
        requirements += optional[extra]
    bounds, unbounded = lower_bounds(requirements)
    notes = [f"no lower bound, floats: {text}" for text in unbounded]
    for name in floating:
        if bounds.pop(normalize(name), None) is None:
            raise ValueError(f"--float {name}: pyproject.toml bounds no such requirement")
        notes.append(f"floats (--float): {name}")
    return [f"{name}=={version}" for _, (name, version) in sorted(bounds.items())], notes


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--extra", action="append", default=[], help="an extra to pin too")
    parser.add_argument("--float", dest="floating", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    import tomllib  # Python 3.11+ (ruff targets 3.10)

    project = tomllib.loads(args.pyproject.read_text())["project"]
    try:
        lines, notes = pins(project, args.extra, args.floating)
    except ValueError as exc:
        print(f"min_versions: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"min_versions: {note}", file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
