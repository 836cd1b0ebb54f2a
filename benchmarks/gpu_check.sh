#!/usr/bin/env bash
# pagoda on a lent GPU in one call of at most 8 minutes: the CUDA test subset, single-stream
# decode against the HBM roofline (Llama-3-8B and Qwen3-0.6B shapes, random bf16 weights), the
# nano-vllm workload against transformers, and a profiled decode step at batch 1 and 64.
#
#   benchmarks/gpu_check.sh                 # on the GPU machine, from the repository root, .whl/ beside it
#   PYTHON=.venv/bin/python PYTHONPATH=/tmp/triton-site GPU_CHECK_SCALE=3 benchmarks/gpu_check.sh --dry-run  # here
#   benchmarks/gpu_check.sh --only tests,llama                   # a re-run of some stages
#
# Every result is written to $OUT (default /tmp/gpu_check) as soon as it exists, so a run cut
# off still returns what it did (8 files, see benchmarks/README.md). Each stage runs under
# `timeout` with its own budget, cut to what is left of TOTAL_S.
#
# --dry-run: TRITON_INTERPRET=1, the tests that need CUDA skip (tests/gpu runs on the CPU), the
# wheels are checked (tools/gpu_bundle.sh --check) and installed for the GPU machine's tags into
# a scratch folder instead of onto the path, and the benchmarks run the tiny model on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

# ---- what runs: edit here ------------------------------------------------------------------
# The CUDA subset. Files that moved are found again by name under tests/, and every test file
# named like TEST_NAME_PATTERNS or whose text matches TEST_CONTENT_PATTERN (a module of Triton
# kernels imported for a test, or a CUDA check) joins, so a moved or renamed file is still run; a
# listed name found nowhere is reported in check.log.
TEST_FILES=(
    tests/kernels/test_triton_attention.py     # paged prefill, split-KV decode (windows, soft-capping, sinks), quantized KV
    tests/worker/test_cuda_graphs.py           # decode graph replay against the eager forward
    tests/kernels/test_triton_weight_kernels.py  # w8a16 / w4a16 weight kernels
    tests/kernels/test_triton_lora.py           # LoRA shrink / expand
    tests/kernels/test_triton_moe.py           # fused MoE (and its graph capture)
    tests/gpu/test_cuda_paths.py               # the device grammar bitmask, the pinned host KV tier
)
TEST_NAME_PATTERNS=('test_triton_*.py' 'test_cuda_*.py')
TEST_CONTENT_PATTERN='import_triton_module|cuda\.is_available\(\)'
PER_TEST_TIMEOUT_S=60
TEST_WORKERS=6         # pytest-xdist processes, where it is installed: Triton compiles on the CPU, one kernel a process
TOTAL_S=470            # the whole script, from its start
BUDGET_ENV_S=20
BUDGET_INSTALL_S=60
BUDGET_TESTS_S=150
BUDGET_LLAMA_S=140
BUDGET_QWEN_S=300       # the last stage: in practice what is left of TOTAL_S
STAGES=env,install,tests,llama,qwen

DRY_RUN=0
while (( $# )); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --only) STAGES=env,install,$2; shift ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if (( DRY_RUN )); then
    export TRITON_INTERPRET=1 PAGODA_GPU_TESTS_DEVICE=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$OUT/check.log"; }
wants() { [[ ",$STAGES," == *",$1,"* ]]; }
# Seconds for a stage: its budget, or what is left of TOTAL_S if less; GPU_CHECK_SCALE (an integer,
# default 1) stretches every budget, for a dry run on a loaded CPU.
SCALE=${GPU_CHECK_SCALE:-1}
budget() { local want=$(($1 * SCALE)) left=$((TOTAL_S * SCALE - SECONDS)); echo $((want < left ? want : left)); }
# run_stage NAME BUDGET FUNCTION: the function's commands run under `t` (timeout of the stage's
# seconds, STAGE_S, each); its output is appended to check.log.
run_stage() {
    local name=$1 fn=$3
    STAGE_S=$(budget "$2")
    if (( STAGE_S < 15 )); then log "$name: skipped, ${STAGE_S}s left of $((TOTAL_S * SCALE))s"; return 0; fi
    log "$name: start (budget ${STAGE_S}s)"
    "$fn" >>"$OUT/check.log" 2>&1
    local rc=$?
    if (( rc == 124 || rc == 137 )); then log "$name: cut off after ${STAGE_S}s"; else log "$name: end, rc=$rc"; fi
    return 0
}
t() { timeout --kill-after=10 "$STAGE_S" "$@"; }

stage_env() {
    {
        echo "date: $(date -u +%FT%TZ)"; echo "commit: $(git rev-parse HEAD 2>/dev/null || echo none)"
        echo "host: $(uname -a)"; echo "cpus: $(nproc)"; free -g 2>/dev/null | head -2
        echo; t nvidia-smi 2>&1 || echo "no nvidia-smi"
        t nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
        echo; t "$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
          f"{p.total_memory / 2**30:.1f} GiB")
else:
    print("device: no CUDA device,", platform.processor() or platform.machine())
for name in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "typing-extensions", "anyio",
             "h11", "click", "jinja2", "pytest", "pytest-timeout", "accelerate"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
EOF
    } >"$OUT/env.txt" 2>&1
    grep -E "^(device|torch|triton|python)[: ]" "$OUT/env.txt" | tee -a "$OUT/check.log"
}

stage_install() {
    local tags=()
    if (( DRY_RUN )); then  # the wheels are for CPython 3.12: installed for those tags, off the path
        PYTHON=$PY t bash tools/gpu_bundle.sh --check || return $?
        tags=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
              --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
        SITE=$(mktemp -d)/site
    fi
    t "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "${tags[@]}" \
        --target "$SITE" .whl/*.whl || return $?
    ls "$SITE"
    # pagoda itself is on the path as this checkout, against the machine's torch.
    t "$PY" -c "import pagoda, fastapi, uvicorn, llguidance, gguf; from pagoda import LLM; print('imports ok:', pagoda.__file__)"
}

test_files() {
    local listed found=() name
    for listed in "${TEST_FILES[@]}"; do
        if [[ -f $listed ]]; then found+=("$listed"); continue; fi
        name=$(find tests -name "$(basename "$listed")" -print -quit)
        if [[ -n $name ]]; then found+=("$name"); else log "tests: $listed not found anywhere under tests/" >&2; fi
    done
    for name in "${TEST_NAME_PATTERNS[@]}"; do
        while IFS= read -r listed; do found+=("$listed"); done < <(find tests -name "$name" | sort)
    done
    while IFS= read -r listed; do found+=("$listed"); done \
        < <(grep -rlE "$TEST_CONTENT_PATTERN" tests --include='test_*.py' | sort)
    printf '%s\n' "${found[@]}" | awk '!seen[$0]++'
}

stage_tests() {
    mapfile -t files < <(test_files)
    echo "test files: ${files[*]}"
    local workers=()
    # A test past its timeout takes its worker down (stacks dumped), and xdist starts another: a
    # kernel that hangs costs one test, not the stage.
    if "$PY" -c "import xdist" 2>/dev/null; then
        workers=(-n "$((DRY_RUN ? 2 : TEST_WORKERS))" --timeout-method=thread)
    fi
    t "$PY" -m pytest -p no:cacheprovider "${workers[@]}" -v -rfEs --timeout "$PER_TEST_TIMEOUT_S" --durations=15 \
        --junitxml "$OUT/tests.xml" "${files[@]}" >"$OUT/tests.log" 2>&1
    local rc=$?
    tail -n 1 "$OUT/tests.log"
    return $rc
}

bench_args() {  # the shapes on the GPU; the tiny model on the CPU for a dry run
    if (( DRY_RUN )); then
        echo --models tiny --device cpu --num-seqs 6 --min-len 8 --max-len 40 --single-prompt-len 24 \
            --single-output-len 16 --hf-num-seqs 3 --hf-batch-size 2 --hf-single-output-len 8 \
            --profile-batches 1,4 --bandwidth-bytes $((64 << 20))
    else
        echo "$@"
    fi
}

stage_llama() {  # single stream against the roofline, no transformers
    t "$PY" benchmarks/gpu.py $(bench_args --models llama3-8b --single-output-len 256 --profile-batches 1,64) \
        --skip-offline --skip-hf --profile-out "$OUT/profile.txt" \
        --out "$OUT/bench-llama3-8b.json" >>"$OUT/bench.log" 2>&1
}

stage_qwen() {  # single stream, the nano-vllm workload (transformers on its first 64 requests)
    t "$PY" benchmarks/gpu.py $(bench_args --models qwen3-0.6b --num-seqs 256 --hf-num-seqs 64 --hf-batch-size 64 \
        --hf-single-output-len 128 --profile-batches 1,64) --hf-device-map --profile-out "$OUT/profile.txt" \
        --out "$OUT/bench-qwen3-0.6b.json" >>"$OUT/bench.log" 2>&1
}

summary() {
    echo "==== summary (full logs in \$OUT: check.log tests.log tests.xml bench.log profile.txt *.json env.txt)"
    grep -E "^(device|torch|triton)[: ]" "$OUT/env.txt" 2>/dev/null
    grep -E ": (start|end|cut off|skipped)" "$OUT/check.log"
    [[ -f $OUT/tests.log ]] && { grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -40; tail -n 1 "$OUT/tests.log"; }
    [[ -f $OUT/bench.log ]] && grep -vE "Loading weights|it/s\]|profiler_st" "$OUT/bench.log" | tail -n 40
}

SITE=/tmp/site
log "gpu_check: stages $STAGES, dry run $DRY_RUN, python $PY, out $OUT"
# The bundle on the path before the checkout (a dry run uses this interpreter's own packages).
if (( DRY_RUN )); then export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
else export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}; fi
wants env && run_stage env "$BUDGET_ENV_S" stage_env
wants install && run_stage install "$BUDGET_INSTALL_S" stage_install
wants tests && run_stage tests "$BUDGET_TESTS_S" stage_tests
wants llama && run_stage llama "$BUDGET_LLAMA_S" stage_llama
wants qwen && run_stage qwen "$BUDGET_QWEN_S" stage_qwen
log "gpu_check: done in ${SECONDS}s"
summary
