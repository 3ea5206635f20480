"""The ``vitserve`` console script: make-model and the offline demo, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VITSERVE = str(Path(sys.executable).parent / "vitserve")


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VITSERVE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([VITSERVE, *args], capture_output=True, text=True, env=env, timeout=600)


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


def test_demo_runs_offline_and_reports_keys_batches_timings(tmp_path) -> None:
    proc = _run("demo", "--preset", "tiny", "--dtype", "fp32", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "random-weight qwen2_vl (tiny)" in out
    assert (tmp_path / "models" / "qwen2_vl-tiny-seed0" / "config.json").is_file()
    assert "(same bytes as #0)" in out
    assert "tower forwards for 6 distinct images" in out
    assert "encoded in" in out and "images/s" in out
    # built once: a second run reuses the cached model
    again = _run("demo", "--preset", "tiny", "--dtype", "fp32", cache=tmp_path)
    assert again.returncode == 0, again.stderr


def test_demo_with_a_missing_model_fails_clearly(tmp_path) -> None:
    proc = _run("demo", "--model", str(tmp_path / "missing"), cache=tmp_path)
    assert proc.returncode == 2
    assert "vitserve: error: cannot load model" in proc.stderr
    assert "Traceback" not in proc.stderr
