#!/usr/bin/env bash
# The whole GPU check in one call, sized for a short lease: the CUDA tests (pytest -m cuda), the torch.compile tests
# on the machine's own torch, then benchmarks/gpu.py. Everything lands in $OUT (default /tmp/cuda_check).
#   bash benchmarks/cuda_check.sh                      # on a CUDA machine
#   ATTENTION_ARGS="--device cpu --quick" TRAINING_ARGS="--device cpu --quick" bash benchmarks/cuda_check.sh  # rehearsal
# Wheels in .whl/ (transformers and the like, for a machine without internet) are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
start=$(date +%s)
stamp() { echo "== $1 at +$(($(date +%s) - start)) s"; }
$PY -c "import torch, transformers; import importlib.util as u
print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '')
if u.find_spec('triton'): import triton; print('triton', triton.__version__)" 2>&1 | tee "$OUT/versions.txt"
stamp "torch.compile tests on this torch (CPU, in the background) and the CUDA tests"
(timeout "${COMPILE_S:-240}" $PY -m pytest -q -p no:cacheprovider tests/modeling/test_compile.py >"$OUT/compile_tests.log" 2>&1
 echo "exit $?" >>"$OUT/compile_tests.log") &
compile_job=$!
timeout "${CUDA_TESTS_S:-150}" $PY -m pytest -m cuda -q -p no:cacheprovider tests ${CUDA_TEST_ARGS:-} \
    >"$OUT/cuda_tests.log" 2>&1
echo "exit $?" >>"$OUT/cuda_tests.log"
tail -30 "$OUT/cuda_tests.log"
stamp "benchmarks/gpu.py, attention"
kernels=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu
print(' '.join(k for k in gpu.attention_kernels() if not k.endswith('/reference')))")
# shellcheck disable=SC2086
timeout "${ATTENTION_S:-200}" $PY benchmarks/gpu.py --out "$OUT" --only attention --timeout 120 --kernels $kernels \
    ${ATTENTION_ARGS:---lengths 4096 16384 65536} >"$OUT/gpu_attention.log" 2>&1
echo "exit $?" >>"$OUT/gpu_attention.log"
stamp "benchmarks/gpu.py, training"
# shellcheck disable=SC2086
timeout "${TRAINING_S:-120}" $PY benchmarks/gpu.py --out "$OUT" --only training --timeout 100 \
    ${TRAINING_ARGS:---lengths 16384 65536} >"$OUT/gpu_training.log" 2>&1
echo "exit $?" >>"$OUT/gpu_training.log"
tail -70 "$OUT/gpu_training.log"
stamp "waiting for the compile tests"
wait $compile_job
tail -8 "$OUT/compile_tests.log"
stamp "done"
