"""Model folders for the loaders' offline tests: a Hugging Face hub cache holding a test model
as a repo, and a checkpoint copied with its tensors renamed (the hub's older layouts). The test
models themselves are :mod:`vitserve.testing.models`."""

from __future__ import annotations

import shutil
from pathlib import Path

from vitserve.testing.models import _rename_in_place


def fake_hub_cache(src: Path, cache: Path, repo: str, files: list[str]) -> str:
    """A huggingface_hub cache under ``cache`` holding only ``files`` of the model folder
    ``src`` as repo ``repo`` at one snapshot (offline tests of loading by HF id); its commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for name in files:
        shutil.copy(src / name, snapshot / name)
    return commit


def rename_tensors(src: Path, dst: Path, rules: list[tuple[str, str]]) -> None:
    """Copy the sharded checkpoint ``src`` to ``dst`` with every tensor name rewritten by the
    regex ``rules`` (``re.sub(pattern, repl)`` in order), shards and index kept (tests of
    older hub layouts)."""
    shutil.copytree(src, dst)
    _rename_in_place(dst, rules)
