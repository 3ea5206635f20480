"""``vitserve.client.adapters.vllm_inputs`` against vLLM's offline ``LLM`` (check_adapter.py):
vLLM fed vitserve's embeddings of two images generates what vLLM fed their pixels does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .conftest import vllm_python

CHECK = Path(__file__).with_name("check_adapter.py")


def test_vllm_inputs_equal_pixels_in_vllm(model_dir: Path, tmp_path: Path) -> None:
    common = ["--model", str(model_dir), "--dtype", "fp32", "--out", str(tmp_path / "e.npz")]
    subprocess.run([sys.executable, str(CHECK), "--encode", *common], check=True)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [vllm_python(), str(CHECK), "--vllm", *common], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "token ids identical: True" in run.stdout
