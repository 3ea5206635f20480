"""Running the ``vitserve`` console script as a user does, for the tests that start it
(``tests/deployments/test_cli.py``, ``tests/reliability/test_shutdown.py``)."""

from __future__ import annotations

import os
import signal
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
    proc: subprocess.Popen,
    url: str,
    timeout: float = 180,
    path: str = "/healthz",
    log: Path | None = None,
    statuses: tuple[int, ...] = (200,),
) -> None:
    """Return once ``url``'s ``path`` (an application's health route) answers 200 (or another
    of ``statuses``: a route that answers at all); fail if
    ``proc`` exits first (with its output: its pipe, or the tail of ``log``, the file it
    writes to) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            out += log.read_text(errors="replace")[-4000:] if log is not None else ""
            raise AssertionError(f"vitserve exited {proc.returncode} before it was healthy:\n{out}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code in statuses:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"vitserve serve did not answer within {timeout} s")


def stop(proc: subprocess.Popen, how: int = signal.SIGINT, timeout: float = 90) -> int | None:
    """Send ``how`` to ``proc`` and wait up to ``timeout`` s for it to exit: its exit code, or
    None if it did not, after killing its whole process group (start it with
    ``start_new_session=True``), so a stuck server and its Ray cluster never outlive the test."""
    if proc.poll() is None:
        proc.send_signal(how)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return None
