"""Start ``vitserve serve`` for a run and stop it after; record the replica counts.

The server runs as ``python -m loadtest.harness.server serve --model demo --port P ...``: the
``vitserve`` CLI's own ``main`` (the same code as ``.venv/bin/vitserve serve``) in the main
thread, plus a thread that, once Serve is up in this process (the one that started Ray), polls
``serve.status()`` every second and appends ``{"t", "replicas": {deployment: running}}`` lines
to the file named by ``LOADTEST_REPLICAS_LOG``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def _poll_replicas(path: str, stop: threading.Event) -> None:
    import ray

    while not stop.is_set() and not ray.is_initialized():
        time.sleep(0.5)
    from ray import serve

    with open(path, "a") as f:
        while not stop.is_set():
            try:
                status = serve.status()
                counts = {}
                for app in status.applications.values():
                    for name, dep in app.deployments.items():
                        counts[name] = sum(
                            n
                            for s, n in dep.replica_states.items()
                            if str(getattr(s, "value", s)) == "RUNNING"
                        )
                f.write(json.dumps({"t": time.time(), "replicas": counts}) + "\n")
                f.flush()
            except Exception:  # Serve not up yet, or shutting down
                pass
            stop.wait(1.0)


def main(argv: list[str]) -> int:
    from vitserve.deployments.runner.cli import main as cli_main

    path = os.environ.get("LOADTEST_REPLICAS_LOG")
    stop = threading.Event()
    if path:
        # Ray imported here, before the thread: a thread's first `import ray` racing the CLI's
        # own (ray.serve) in the main thread failed with a partially initialized
        # ray._private.worker (seen 2026-11-26)
        import ray  # noqa: F401

        threading.Thread(target=_poll_replicas, args=(path, stop), daemon=True).start()
    try:
        return cli_main(argv)
    finally:
        stop.set()


class Server:
    """A ``vitserve serve`` subprocess (own session, so it and Ray's processes stop together)."""

    def __init__(self, port: int, extra: list[str], out_dir: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.replicas_log = out_dir / "replicas.jsonl"
        self.log = open(out_dir / "server.log", "w")  # noqa: SIM115 (closed in stop)
        args = [
            sys.executable,
            "-m",
            "loadtest.harness.server",
            "serve",
            "--model",
            "demo",
            "--port",
            str(port),
            *extra,
        ]
        env = dict(os.environ, LOADTEST_REPLICAS_LOG=str(self.replicas_log))
        env.setdefault("RAY_AUTH_MODE", "disabled")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready in {timeout_s} s; see {self.log.name}")

    def stop(self, timeout_s: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Ray's own processes (raylet, workers) are in the server's session: end any left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def read_replicas(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
