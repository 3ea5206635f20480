"""The ``vitserve`` console script as a user runs it: make-model, serve + encode, and demo.

``serve`` and ``demo`` start their own local Ray cluster (beside the test session's), offline
(``HF_HUB_OFFLINE``), with a model cache folder that starts empty, on the embedded default: the
node-local store, no Redis configured anywhere (``VITSERVE_*`` and ``REDIS*`` variables are
removed from their environment).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitserve.encoder.testimages import make_image

VITSERVE = str(Path(sys.executable).parent / "vitserve")


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VITSERVE_", "REDIS", "RAY_ADDRESS"))}  # fmt: skip
    return {**env, "VITSERVE_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}  # fmt: skip


def _run(*args: str, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([VITSERVE, *args], capture_output=True, text=True, env=_env(cache),
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's cache folder: empty at first, so the demo model is built by the first run."""
    return tmp_path_factory.mktemp("user-cache")


def test_make_model_writes_a_loadable_sharded_checkpoint(tmp_path) -> None:
    from vitserve.encoder.engine import EncoderEngine

    out = tmp_path / "llava-tiny"
    proc = _run("make-model", "--family", "llava", "--preset", "tiny", str(out), cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["model_type"] == "llava"
    engine = EncoderEngine.from_pretrained(str(out), device="cpu", dtype="fp32")
    assert engine.family == "llava"


def test_make_model_rejects_unknown_family(tmp_path) -> None:
    proc = _run("make-model", "--family", "bert", str(tmp_path / "x"), cache=tmp_path)
    assert proc.returncode == 2
    assert "invalid choice: 'bert'" in proc.stderr


def test_serve_demo_then_encode_through_http_then_ctrl_c(tmp_path, user_cache) -> None:
    from vitserve.deployments.local import free_port

    port = free_port()
    proc = subprocess.Popen([VITSERVE, "serve", "--model", "demo", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(user_cache))  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "vitserve is serving" in line:
                break
        out = "".join(lines)
        assert f"at http://127.0.0.1:{port}" in out, out
        effective = json.loads(re.search(r"effective config: (\{.*\})", out)[1])
        assert effective["store"] == "node://" and effective["model"] == "demo"

        files = []
        for i, (w, h) in enumerate([(448, 448), (320, 240), (640, 480)]):
            files.append(tmp_path / f"img{i}.png")
            files[-1].write_bytes(make_image(w, h, seed=500 + i))
        url = f"http://127.0.0.1:{port}"
        first = _run("encode", *map(str, files), "--url", url, cache=user_cache)
        assert first.returncode == 0, first.stderr
        rows = [line.split("\t") for line in first.stdout.splitlines()]
        assert [r[0] for r in rows] == list(map(str, files))
        assert all(re.fullmatch(r"[0-9a-f]{64}", r[1]) and r[3] == "encoded" for r in rows)
        assert [r[2] for r in rows] == ["256 tokens", "99 tokens", "391 tokens"]
        again = _run("encode", str(files[0]), "--url", url, cache=user_cache)
        assert again.stdout.split("\t")[1] == rows[0][1] and "cached" in again.stdout

        bad = tmp_path / "bad.png"
        bad.write_bytes(b"not an image")
        failed = _run("encode", str(bad), "--url", url, cache=user_cache)
        assert failed.returncode == 1 and "not a recognised image" in failed.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0


def test_encode_against_no_server_fails_clearly(tmp_path) -> None:
    from vitserve.deployments.local import free_port

    image = tmp_path / "a.png"
    image.write_bytes(make_image(64, 64))
    proc = _run("encode", str(image), "--url", f"http://127.0.0.1:{free_port()}",
                cache=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "cannot reach" in proc.stderr


def test_demo_serves_encodes_twice_and_the_second_pass_comes_from_the_store(user_cache) -> None:
    proc = _run("demo", cache=user_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "store node://" in out
    first, second = out.split("\nfirst pass:")[1].split("\nsecond pass:")
    m = re.match(r" 7 images in [0-9.]+ s over HTTP, 6 through the tower in (\d+) forwards", first)
    assert m and int(m[1]) < 6, first
    assert first.count("encoded") == 7
    assert "0 through the tower in 0 forwards" in second
    assert second.count("store (cached)") == 7
    assert re.search(r"GET /v1/embeddings/[0-9a-f]{16}\.\.: 200, \d+ bytes", out)


def test_demo_with_a_missing_model_fails_clearly_before_starting_anything(tmp_path) -> None:
    started = time.monotonic()
    proc = _run("demo", "--model", str(tmp_path / "missing"), cache=tmp_path)
    assert proc.returncode == 2
    assert "vitserve: error: cannot load model" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 60
