"""The dependency rules of the design brief, checked in fresh interpreters, and packaging."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    code = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {line.split(".")[0] for line in out.stdout.split()}


def _modules_after_import(module: str) -> set[str]:
    return _modules_after(f"import {module}")


def test_encoder_never_imports_ray_redis_or_http(tiny_models) -> None:
    """A whole encode (load, decode, preprocess, forward) loads no Ray, Redis or HTTP code."""
    loaded = _modules_after(
        "from vitserve.encoder.engine import EncoderEngine\n"
        "from vitserve.encoder.testimages import make_image\n"
        f"engine = EncoderEngine.from_pretrained({str(tiny_models['qwen3_vl'])!r})\n"
        "assert engine.encode([make_image(64, 64)])[0].num_tokens > 0\n"
    )
    assert {"torch", "transformers"} <= loaded  # else the check would be vacuous
    assert not loaded & {"ray", "redis", "httpx", "fastapi", "starlette", "aiohttp"}


@pytest.mark.parametrize("module", ["vitserve.keys", "vitserve.encoder.planner",
                                    "vitserve.encoder.images", "vitserve"])  # fmt: skip
def test_light_modules_do_not_import_torch(module: str) -> None:
    assert "torch" not in _modules_after_import(module)


def test_cache_never_imports_torch_or_transformers(redis_url) -> None:
    """A whole store round trip (codec, memory, Redis, tiered, URLs) loads neither."""
    loaded = _modules_after(
        "from vitserve.cache import open_store, tiered_url\n"
        "from vitserve.cache.testing import make_record\n"
        "import vitserve.cache.node\n"
        f"store = open_store(tiered_url('memory://', {redis_url!r}, namespace='layering'))\n"
        "record = make_record()\n"
        "store.put_many([record])\n"
        "assert store.get(record.key) is not None\n"
    )
    assert {"redis", "msgpack", "numpy"} <= loaded
    assert not loaded & {"torch", "transformers"}


def test_cli_starts_without_torch() -> None:
    assert "torch" not in _modules_after_import("vitserve.deployments.cli")


def test_wheel_maps_top_level_folders_to_subpackages(tmp_path) -> None:
    """A plain (non-editable) build ships encoder/ as vitserve/encoder/ etc., and the script."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    [wheel] = tmp_path.glob("vitserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("vitserve/__init__.py", "vitserve/errors.py", "vitserve/encoder/engine.py",
                 "vitserve/encoder/families/qwen.py", "vitserve/cache/__init__.py",
                 "vitserve/client/__init__.py", "vitserve/deployments/cli.py"):  # fmt: skip
        assert path in names, path
    assert not any(n.startswith(("tests/", "encoder/", "loadtest/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vitserve = vitserve.deployments.cli:main" in text
