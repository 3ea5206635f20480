"""Running the ``vitserve`` console script as a user does, for the tests that start it
(``tests/deployments/test_cli.py``, ``tests/reliability/test_shutdown.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from vitserve.encoder.device import HOST_OVERRIDE_VARS

VITSERVE = str(Path(sys.executable).parent / "vitserve")


def cli_env(cache: Path) -> dict[str, str]:
    """This process's environment for the console script, offline, with the model cache
    ``cache``: no ``VITSERVE_*``, ``REDIS*`` or ``RAY_ADDRESS`` of the test session (but the
    CPU-profile overrides a run may set)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VITSERVE_", "REDIS", "RAY_ADDRESS")) or k in HOST_OVERRIDE_VARS
    }
    return {
        **env,
        "VITSERVE_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
    }


def wait_healthy(
    proc: subprocess.Popen, url: str, timeout: float = 180, path: str = "/healthz"
) -> None:
    """Return once ``url``'s ``path`` (an application's health route) answers 200; fail if
    ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"vitserve serve did not answer within {timeout} s")
