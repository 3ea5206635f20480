"""loadtest/bench_gpu.py cannot rot: its smoke run (``--device cpu --tiny``) measures both
strategies on the tiny tower and writes its page, and it refuses clearly where it cannot
measure what it is for (no working CUDA device; a CPU without ``--tiny``). In-process: the
script's ``main`` is called, so nothing is started."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vitserve.encoder.device import CudaProbe

SCRIPT = Path(__file__).resolve().parents[2] / "loadtest" / "bench_gpu.py"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (in sys.modules while it runs: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _row(page: str, strategy: str) -> list[str]:
    [line] = [line for line in page.splitlines() if line.startswith(f"| {strategy} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_smoke_run_measures_both_strategies_and_writes_its_page(
    bench: ModuleType, tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "page.md"
    argv = ["--device", "cpu", "--tiny", "--dtype", "fp32"]  # one round: --tiny's default
    bench.main([*argv, "--model", str(tiny_models["qwen2_vl"]), "--out", str(out)])
    page = out.read_text()
    images = sum(count for count, _, _ in bench.TINY_SET)
    assert page.startswith("# Bucketed vs per-image encoding, qwen2_vl tower, on cpu (smoke run) (")
    assert f"Workload: {images} images (" in page and "; 1 round." in page
    per, bucketed = _row(page, "per-image"), _row(page, "bucketed")
    assert int(per[4]) == images  # one forward per image
    assert 1 <= int(bucketed[4]) < images  # the planner shares forwards
    for row in (per, bucketed):
        assert float(row[2]) > 0 and row[5] == "n/a"  # images/s; no device memory on a CPU
    ratio = re.search(r"bucketed / per-image throughput: ([\d.]+)x \(per round: ([^;]+);", page)
    assert ratio and float(ratio[1]) > 0 and len(ratio[2].split(", ")) == 1
    ulps = re.search(r"at most ([\d.e+-]+) ulps", page)
    assert ulps and float(ulps[1]) <= 8  # fp32: the engine's batching promise
    assert "Rerun: `.venv/bin/python loadtest/bench_gpu.py --device cpu --tiny" in page
    printed = capsys.readouterr().out
    assert "round 1: bucketed" in printed and page in printed


def test_it_refuses_without_a_working_cuda_device_naming_the_smoke_run(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    detail = "torch.cuda.is_available() is False (torch 2.13.0+cpu, a build without CUDA)"
    monkeypatch.setattr(bench, "probe_cuda", lambda: CudaProbe("absent", detail))
    with pytest.raises(SystemExit) as refused:
        bench.main([])
    assert refused.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"needs a working CUDA device, and here {detail}" in err
    assert "For a smoke run without one: --device cpu --tiny" in err


def test_a_broken_device_is_refused_too(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    detail = "torch.cuda.is_available() is True but a first CUDA op failed: RuntimeError: boom"
    monkeypatch.setattr(bench, "probe_cuda", lambda: CudaProbe("broken", detail))
    with pytest.raises(SystemExit) as refused:
        bench.main(["--rounds", "3"])
    assert refused.value.code == 2
    assert detail in " ".join(capsys.readouterr().err.split())


def test_a_cpu_run_needs_tiny(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "probe_cuda", lambda: pytest.fail("a CPU run probed CUDA"))
    with pytest.raises(SystemExit) as refused:
        bench.main(["--device", "cpu"])
    assert refused.value.code == 2
    assert "--device cpu runs only with --tiny" in capsys.readouterr().err


def test_the_page_is_named_after_the_card(bench: ModuleType) -> None:
    assert bench.page_name("NVIDIA H100 80GB HBM3") == "gpu-nvidia-h100-80gb-hbm3.md"
    assert bench.page_name("NVIDIA H200") == "gpu-nvidia-h200.md"
    assert bench.page_name("Tesla T4 (PCIe)") == "gpu-tesla-t4-pcie.md"
    assert bench.page_name("NVIDIA H200", "qwen3_vl") == "gpu-nvidia-h200-qwen3_vl.md"
