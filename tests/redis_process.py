"""A private ``redis-server`` subprocess on a free port, for tests that stop, restart or
configure their own Redis (``spawn_redis`` in tests/conftest.py, tests/vllm)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


class RedisServer:
    """A private redis-server subprocess on a free port (killed at teardown)."""

    def __init__(self, *args: str) -> None:
        from vitserve.deployments.runner.local import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, attempts: int = 3) -> None:
        """Start on ``self.port``; if the server exits at once (another process took the port
        since it was found free), on a new free port."""
        from vitserve.deployments.runner.local import free_port

        for _ in range(attempts):
            self.proc = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + 10
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            self.kill()
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
        raise RuntimeError(f"redis-server did not start ({attempts} ports tried)")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
