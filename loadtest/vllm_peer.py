"""vLLM (CPU build) as a side-by-side peer: start/stop its OpenAI server and drive its encoder path.

``VllmServer`` runs ``python -m vllm.entrypoints.openai.api_server`` from vLLM's own virtual
environment (see /work/shared/peers/README.md) on a local checkpoint, in its own process group,
and kills the whole group on exit: the server's OpenMP threads spin on the cores, so no engine
may outlive a benchmark. ``post_chat`` sends one ``/v1/chat/completions`` request with the
images as base64 JPEG data URLs and ``max_tokens: 1`` (HTTP, chat template, preprocessing,
vision encoder, a tiny language-model prefill) and returns its wall time.

vLLM keys its multimodal caches (processor and encoder outputs) by a hash of the image content,
so a repeated image is answered from cache: "new image" cases need new pixels in every request.

Standard library and httpx only; torch and vllm are never imported here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time

import httpx

_MAX_IMAGES = 8


class VllmServer:
    """Context manager around one vLLM OpenAI server process group.

    ``extra_env`` is merged into the server's environment, e.g.
    ``{"VLLM_CPU_OMP_THREADS_BIND": "0-1"}``: by default vLLM's CPU backend reserves one core
    and binds a single OpenMP thread on a 2-core machine. ``extra_args`` go at the end of the
    command line (e.g. ``--ec-transfer-config``).
    """

    def __init__(
        self,
        python: str,
        model_dir: str,
        port: int,
        dtype: str = "bfloat16",
        log_path: str | None = None,
        *,
        served_model_name: str = "tiny",
        ready_timeout: float = 180.0,
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        max_images: int = _MAX_IMAGES,
        kv_cache_bytes: int | None = None,
        max_videos: int = 0,
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.port = port
        self.dtype = dtype
        self.log_path = log_path
        self.served_model_name = served_model_name
        self.ready_timeout = ready_timeout
        self.extra_env = dict(extra_env or {})
        self.extra_args = list(extra_args or [])
        self.max_images = max_images
        self.max_videos = max_videos  # videos per prompt (vLLM profiles its encoder for one)
        # its KV cache (None: 1 GiB, VLLM_CPU_KVCACHE_SPACE=1; the variable overrides vLLM's
        # --kv-cache-memory-bytes, so a size in bytes leaves it unset). vLLM's CPU build keeps
        # the cache resident: a tiny model's server held 2430 MiB RSS at 1 GiB, 1469 at 64 MiB
        self.kv_cache_bytes = kv_cache_bytes
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            self.served_model_name,
            "--dtype",
            self.dtype,
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--limit-mm-per-prompt",
            json.dumps({"image": self.max_images, "video": self.max_videos}),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(
                ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
                if self.kv_cache_bytes is not None
                else []
            ),
            *self.extra_args,
        ]

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The server's environment: ``base`` (the caller's), offline, its KV cache's size,
        then ``extra_env``."""
        env = {**base, "HF_HUB_OFFLINE": "1"}
        if self.kv_cache_bytes is None:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        else:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return {**env, **self.extra_env}

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> VllmServer:
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="vllm-peer-", suffix=".log")
            os.close(fd)
        env = self.environment(dict(os.environ))
        self._log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            self._wait_ready(t0)
        except BaseException:
            self._stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        with httpx.Client(timeout=2.0) as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"vLLM server exited with code {rc} during start-up; log "
                        f"{self.log_path} ends:\n{self._log_tail()}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > self.ready_timeout:
                    raise RuntimeError(
                        f"vLLM server not ready after {self.ready_timeout:.0f} s; log "
                        f"{self.log_path} ends:\n{self._log_tail()}"
                    )
                time.sleep(0.5)

    def _group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the leader's pid is the group id
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                if proc.poll() is not None and not self._group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            # children reparented to init may linger for a moment after SIGKILL
            deadline = time.monotonic() + 10.0
            while self._group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __exit__(self, *exc: object) -> None:
        self._stop()


def chat_request_body(jpegs: list[bytes], model: str = "tiny") -> dict:
    """A /v1/chat/completions body: one user message with the JPEGs as data URLs and a text."""
    content: list[dict] = [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(j).decode("ascii")},
        }
        for j in jpegs
    ]
    content.append({"type": "text", "text": "Describe this image."})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    }


def post_chat(client: httpx.Client, url: str, jpegs: list[bytes]) -> float:
    """POST one chat completion to the server at ``url``; return its wall seconds."""
    body = chat_request_body(jpegs)
    t0 = time.perf_counter()
    r = client.post(url.rstrip("/") + "/v1/chat/completions", json=body)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"vLLM answered {r.status_code}: {r.text[:300]}")
    return dt
