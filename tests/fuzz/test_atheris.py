"""Coverage-guided fuzzing of image decoding: tests/fuzz/atheris_images.py under libFuzzer.

The target runs in a subprocess (libFuzzer owns its process: it exits on the first crash),
seeded with small valid images of every allowed format, for ``VITSERVE_TEST_ATHERIS_SECONDS``
(default 12 at full budget, tests/fuzz/budget.py). The test passes when libFuzzer ends by its
time limit with no crash, hang or out-of-memory artifact, and records the number of inputs it
ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fuzz.budget import budget
from vitserve.encoder.images import ALLOWED_FORMATS
from vitserve.testing.images import make_image

TARGET = Path(__file__).with_name("atheris_images.py")
FUZZ_SECONDS = int(os.environ.get("VITSERVE_TEST_ATHERIS_SECONDS", budget(12)))
HANG_S = 10  # libFuzzer's -timeout: one input running this long is a hang (a crash)

# (format, modes): every allowed format, in the modes its encoder writes
SEEDS = {
    "JPEG": ("RGB", "L", "CMYK"),
    "PNG": ("RGB", "RGBA", "L", "LA", "P", "1"),
    "WEBP": ("RGB", "RGBA"),
    "GIF": ("P",),
    "BMP": ("RGB", "P", "L", "1"),
}


def write_seed_corpus(folder: Path) -> int:
    """Small valid images of every allowed format and mode (and two sizes) into ``folder``."""
    assert set(SEEDS) == set(ALLOWED_FORMATS)
    folder.mkdir()
    count = 0
    for fmt, modes in SEEDS.items():
        for mode in modes:
            for i, (w, h) in enumerate(((7, 5), (16, 16))):
                data = make_image(w, h, mode=mode, fmt=fmt, seed=count)
                (folder / f"{fmt}-{mode}-{i}").write_bytes(data)
                count += 1
    return count


def test_coverage_guided_image_decoding(tmp_path: Path, reliability: Any) -> None:
    pytest.importorskip("atheris", reason="atheris comes with the dev extra")
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    seeds = write_seed_corpus(corpus)
    artifacts.mkdir()
    cmd = [
        sys.executable,
        str(TARGET),
        str(corpus),
        f"-max_total_time={FUZZ_SECONDS}",
        f"-timeout={HANG_S}",
        "-rss_limit_mb=2048",
        f"-artifact_prefix={artifacts}/",
        "-print_final_stats=1",
    ]
    # the bound covers start-up (instrumenting PIL) and a slow shared machine
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_SECONDS + 120
    )
    log = proc.stdout + proc.stderr
    crashes = sorted(p.name for p in artifacts.iterdir())
    wrong = len(re.findall(r"AssertionError", log))  # a property of the target, not an escape
    assert proc.returncode == 0 and not crashes, (
        f"libFuzzer exited {proc.returncode}, artifacts {crashes}:\n{log[-4000:]}"
    )
    ran = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    assert ran, log[-4000:]
    runs = int(ran.group(1))
    assert runs >= seeds  # at least the whole seed corpus went through the target
    grown = sum(1 for _ in corpus.iterdir())
    reliability.record(
        "image bytes, coverage-guided (atheris + libFuzzer over the header check and decode)",
        tried=runs,
        failed=len(crashes) - wrong,
        wrong=wrong,
        lost=0,
        note=f"{FUZZ_SECONDS} s from {seeds} valid seeds; corpus grew to {grown}",
    )
