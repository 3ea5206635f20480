#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine: `make test-gpu`'s tests and `make bench-gpu`
# for every family, on a machine whose python3 holds torch with CUDA and nothing else of ours,
# with no package registry (what it lacks travels as wheels in .whl/).
#
# Rule: one script, run from the repository's root, that installs what it needs into a folder of
# its own, runs the checks, and leaves the logs and the results pages under $OUT.
#
# Invariants:
# * Nothing is fetched: the project and the wheels in .whl/ (transformers at the version the
#   project is tested with, blake3) are installed with --no-index into $SITE.
# * The checks run from a copy of tests/ and loadtest/ outside the checkout, so `vitserve`
#   is the installed package (the checkout's folders map onto it only when installed).
# * Exit status: the tests' (non-zero when one failed); a bench that fails is logged and
#   counted, and makes the status non-zero too.
#
# Prepare (here, once): python3 -m pip download --no-deps --only-binary=:all: --python-version
#   3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 blake3
# Run (there):   bash loadtest/gpu_check.sh            (FAMILIES="qwen2_vl qwen3_vl" for fewer)
set -uo pipefail

PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/build/gpu-check}
SITE=${SITE:-/tmp/vitserve-site}
WORK=${WORK:-/tmp/vitserve-gpu-work}
FAMILIES=${FAMILIES:-"qwen2_vl qwen2_5_vl qwen3_vl qwen3_5 gemma3 gemma4 llava vipllava"}
ROUNDS=${ROUNDS:-5}
ROOT=$PWD
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
  --target "$SITE" "$ROOT" || exit 2
export PYTHONPATH=$SITE

rm -rf "$WORK" && mkdir -p "$WORK" && cp -r tests loadtest pyproject.toml "$WORK"/
rm -f "$WORK"/loadtest/results/gpu-*.md
cd "$WORK" || exit 2
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"

VITSERVE_REQUIRE_GPU=1 "$PY" -m pytest -q -p no:cacheprovider -m gpu -ra \
  tests/test_gpu_tier.py tests/encoder/test_cuda.py tests/client/test_cuda_fetch.py \
  tests/deployments/test_cuda_publish.py 2>&1 | tee "$OUT/test-gpu.log"
status=${PIPESTATUS[0]}

for family in $FAMILIES; do
  echo "== bench-gpu $family" | tee -a "$OUT/bench-gpu.log"
  "$PY" loadtest/bench_gpu.py --family "$family" --rounds "$ROUNDS" 2>&1 | tee -a "$OUT/bench-gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
# Gemma 4's tower on images and video frames, one at a time vs batched (issue 41's page)
echo "== bench-gemma4" | tee "$OUT/bench-gemma4.log"
"$PY" loadtest/bench_gemma4.py --preset large --device cuda --dtype bf16 --images 64 --clips 8 \
  2>&1 | tee -a "$OUT/bench-gemma4.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
tar -C loadtest/results -czf "$OUT/gpu-pages.tgz" $(cd loadtest/results && ls gpu-*.md 2>/dev/null)
exit "$status"
