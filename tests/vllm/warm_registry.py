"""Fill vLLM's model-info cache for the test models, so no vLLM server start pays its probe.

A vLLM server's first start on an architecture inspects the model class in a subprocess that
imports vLLM and the model's module (``_run_in_subprocess`` in
``vllm/model_executor/models/registry.py``, 0.32), then caches the answer under
``$VLLM_CACHE_ROOT/modelinfos`` (``~/.cache/vllm``), keyed by the module file's hash: measured on a
2-vCPU EPYC, a cold start of the tiny Qwen2.5-VL took 29 s against 20 s warm, and the four
servers ``test_families.py`` starts at once each probed beside the others. ``.ci/run`` runs this
(``make vllm-registry``) at nice 19 beside the system tier, after vLLM's venv is built, so the
vLLM step starts every server warm. Run with vLLM's venv's python, the model folders as
arguments (``python -m tests.vllm.families`` prints them).

Invariants:
- each folder's architecture goes through vLLM's own ``ModelConfig``, the path a server's start
  takes, so the cache entry is the one the server looks up;
- the run fails unless every folder's entry exists afterwards (a cache vLLM stopped writing, or
  moved, is an error here, not a silent slow start later).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(folders: list[str]) -> int:
    if not folders:
        print("usage: warm_registry.py MODEL_FOLDER...", file=sys.stderr)
        return 2
    import vllm.envs as envs
    from vllm.config import ModelConfig

    cache = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    missing = []
    for folder in folders:
        before = set(cache.glob("*.json")) if cache.is_dir() else set()
        started = time.perf_counter()
        config = ModelConfig(model=folder, dtype="float32")
        took = time.perf_counter() - started
        arch = config.architectures[0]
        entries = [p for p in cache.glob("*.json") if p.stem.endswith(f"-{arch}")]
        state = "probed" if set(entries) - before else "cached"
        print(f"{arch}: {state} in {took:.1f} s ({folder})")
        if not entries:
            missing.append(arch)
    if missing:
        print(f"no model-info entry under {cache} for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
