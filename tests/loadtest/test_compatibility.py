"""``loadtest/compatibility.py``: the table from each job's versions and `.ci/run`'s steps file
(pure: no venv is asked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.compatibility import (
    JOBS,
    MISSING,
    NOT_INSTALLED,
    Job,
    components,
    kuberay,
    read_steps,
    render,
)

STEPS_TSV = (
    "make install\t50.7\t0\n"
    "make test\t389.9\t0\n"
    "make test-system\t608.1\t0\n"
    "make test-multinode\t133.5\t0\n"
    "make test-profiles\t138.4\t0\n"
    "make test-min-versions\t210.2\t1\n"
    ".ci/run, whole\t1937.9\t0\n"
)
VERSIONS = {
    "main job": {"python": "3.11.7", "ray": "2.60.0", "transformers": "5.24.0", "vllm": None},
    "minimum job": {"python": "3.11.7", "ray": "2.60.0", "transformers": "5.23.0", "vllm": None},
    "vLLM job": None,  # no .venv-vllm
}


def _rows(page: str) -> dict[str, list[str]]:
    rows = {}
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith("| component"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_each_job_shows_its_venvs_versions_a_missing_package_and_a_missing_venv() -> None:
    rows = _rows(render(["ray", "transformers", "vllm"], VERSIONS, read_steps(STEPS_TSV)))
    assert rows["Python"] == ["3.11.7", "3.11.7", NOT_INSTALLED]
    assert rows["ray"] == ["2.60.0", "2.60.0", NOT_INSTALLED]
    assert rows["transformers"] == ["5.24.0", "5.23.0", NOT_INSTALLED]
    assert rows["vllm"] == [MISSING, MISSING, NOT_INSTALLED]
    assert rows["venv"] == ["`.venv`", "`build/min-venv`", "`.venv-vllm`"]


def test_a_job_passes_only_when_every_step_of_it_ran_and_exited_0() -> None:
    (main, minimum, vllm) = _rows(render([], VERSIONS, read_steps(STEPS_TSV)))["CI steps"]
    assert main.startswith("passed: ") and "`make test-profiles` passed" in main
    assert minimum == "NOT passed: `make test-min-versions` exit 1"
    assert vllm == "NOT passed: `make test-vllm` not run"


def test_the_same_inputs_give_the_same_page_and_a_cell_cannot_break_the_table() -> None:
    jobs = (Job("only", "v", ("s",)),)
    versions = {"only": {"python": "3.10.1", "odd": "1|2"}}
    page = render(["odd"], versions, {"s": 0}, jobs, ("crds", "declared"))
    assert page == render(["odd"], versions, {"s": 0}, jobs, ("crds", "declared"))
    assert "| odd | 1/2 |" in page
    assert "| KubeRay CRDs (tests/k8s) | crds |" in page
    assert all(line.count("|") == 3 for line in page.splitlines() if line.startswith("|"))


def test_a_malformed_steps_line_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="line 2"):
        read_steps("make test\t1.0\t0\nmake test 1.0 0\n")


def test_components_follow_pyproject_then_the_notable_ones_each_once(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\ndependencies = ["httpx>=0.27"]\n'
        '[project.optional-dependencies]\nserver = ["ray[serve]>=2.60", "starlette>=1"]\n'
    )
    names = components(tmp_path / "pyproject.toml")
    assert names[:3] == ["httpx", "ray", "starlette"]
    assert names.count("starlette") == 1 and "vllm" in names


def test_kuberay_names_the_crds_tag_and_what_the_manifest_declares(tmp_path: Path) -> None:
    crds = tmp_path / "kuberay" / "crds"
    crds.mkdir(parents=True)
    (crds.parent / "README.md").write_text("main branch as of\n2026-08-19, after tag v1.7.0.\n")
    (crds / "ray.io_rayservices.yaml").write_text("spec:\n  versions:\n  - a: 1\n    name: v1\n")
    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text('apiVersion: ray.io/v1\nkind: RayService\n    rayVersion: "2.60.0"\n')
    validated, declared = kuberay(crds, manifest)
    assert validated == "KubeRay main after v1.7.0 (2026-08-19); RayService v1, validated as v1"
    assert declared == "ray.io/v1, rayVersion 2.60.0"
    assert kuberay(None, tmp_path / "absent.yaml")[1] == "not found"


def test_the_jobs_name_the_ci_steps_that_exist() -> None:
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    for job in JOBS:
        for step in job.steps:
            assert f'step "{step}"' in ci, step
