#!/usr/bin/env bash
# The GPU session of issue 16 in a few device calls: bash benchmarks/gpu_session.sh STAGE [STAGE ...]
#
# For a lent NVIDIA H100 / H200 with no network (its image: python3 with torch, triton, pytest, numpy,
# onnx, onnxruntime, safetensors). It runs in the repository root of the copy the device receives,
# imports this checkout through PYTHONPATH=src (pip cannot reach an index there; the `env` stage says
# whether `pip install --no-deps --no-build-isolation -e .` would work offline), writes every log and
# result as a file directly under $OUT (at most 8 come back per call) and prints a short summary last.
# It only reads the GPU's settings (nvidia-smi queries), never changes them.
#
# Stages (several in one call run in order, under one time limit; each step has its own):
#   env         nvidia-smi; python, torch, CUDA, cuDNN, triton versions; the GPU; import rnnkit from
#               src/; rnnkit.backends(); TF32 defaults; a first native and triton call on CUDA.   ~1 min
#   tests       tests/test_gpu.py (native cuDNN reads the packed buffer; triton's compiled kernels),
#               then tests/test_triton.py on CUDA (RNNKIT_TEST_TRITON_DEVICE=cuda, TRITON_INTERPRET=0:
#               tests/conftest.py sets 1 unless it is set), with CUDA-graph replay and without
#               (RNNKIT_TRITON_CUDA_GRAPHS=0, src/rnnkit/triton/graphs.py). No other test of the
#               suite takes a device parameter (the `suite` stage runs the rest).          ~3-5 min
#   correct     benchmarks/gpu_correctness.py --device cuda (every option, float32 / bfloat16 /
#               float16, TF32 off), then its training cases in float32 without graph replay, then
#               the training and wide cases on the Triton per-step GEMM (RNNKIT_TRITON_STEP_GEMM), and
#               every case in bfloat16 / float16 on their own GEMM operands (RNNKIT_TRITON_HALF_GEMM). ~4-6 min
#   bench-fp32 [PART ...]   rnnkit bench --device cuda --dtype float32 --runners torch.nn native triton,
#               training and inference, every variant, with TF32 off for cuBLAS and cuDNN (cuDNN's
#               default TF32 fails float32's 1e-5 check: torch.nn would have no times). PARTs, in
#               order (default all, as time allows): cpu-grid (stream small medium fastrnns wide),
#               deepbench (H 512/1024/2048 x B 16/32/64, T 25), long (H 768, B 16, T 1024), or any
#               one shape of these; the summary's last line names what is left.          <= 8.5 min
#   bench-bf16 [PART ...]   the same in bfloat16 (--dtype bfloat16: every runner, cuDNN included,
#               in bfloat16; torch's default flags).                                          <= 8.5 min
#   suite       the whole test suite on the GPU machine (what CUDA's presence changes; triton's
#               tests there run on CPU under the interpreter, as in CI).                      <= 8.5 min
#   profile     benchmarks/gpu_profile.py: per call, torch.nn / native / triton with and without graph
#               replay and with the Triton per-step GEMM, and profiled triton calls with each (GPU kernel
#               time against wall time, the top kernels); then in bfloat16, triton with its GEMMs on
#               float32 operands (the default) and on bfloat16 ones (RNNKIT_TRITON_HALF_GEMM=half). ~2 min
#   train       rnnkit train --device cuda (2000 steps, the default config) on native, and with
#               --layer-norm on triton: validation bits/char and char/s (issue 16, step 6).   ~1-3 min
#
# Device time is now 15 minutes a session, all calls and starts together: benchmarks/gpu_call.sh
# runs env, tests and correct side by side, profile, then bench-fp32 parts in ONE call of ~9 min.
#
# Run plan (device `run` calls, each with timeout_s 600; chain them without pausing to read the
# results: the machine goes back 30 s after a call, and a new start costs 1-2 minutes of the 30;
# read every call's files afterwards, fix on the CPU, and spend what is left on re-runs):
#   1. bash benchmarks/gpu_session.sh env tests correct        ~6-8.5 min (+1-2 min start); 7 files
#   2. bash benchmarks/gpu_session.sh bench-fp32                stops itself by 8.5 min; 5 files
#   3. GPU_SESSION_LIMIT_S=390 bash benchmarks/gpu_session.sh bench-bf16 cpu-grid deepbench
#                                                               stops itself by 6.5 min; 5 files
#   That is ~26-28 of the 30 minutes. With what is left (a new start needs 4 min left), or in a later
#   session: what a summary names as left (`to finish: ...`, a `correct` cut short, bench-bf16 long),
#   or `tests` again after fixes. Expected durations are estimates: nothing here has run on a GPU.
# Each call stops by GPU_SESSION_LIMIT_S (default 510 s) of its own clock; a step cut short gets
# SIGINT first, so pytest and the benchmark keep and report what they finished.
#
# Locally (no GPU): GPU_SESSION_DRY_RUN=1 bash benchmarks/gpu_session.sh env tests correct bench-fp32
# prints each step's command instead of running it; `env` runs for real anywhere.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/rnnkit-gpu-out}
SCRATCH=${TMPDIR:-/tmp}/rnnkit-gpu-scratch  # full benchmark results, archived into $OUT
mkdir -p "$OUT" "$SCRATCH"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DRY=${GPU_SESSION_DRY_RUN:-0}
LIMIT=${GPU_SESSION_LIMIT_S:-510}
DEADLINE=$((SECONDS + LIMIT))
SUMMARY=()

note() { [[ -n ${*// /} ]] && SUMMARY+=("$*"); return 0; }

# step NAME LOG CAP_S COMMAND...: COMMAND's output appended to $OUT/LOG, under the smaller of CAP_S
# and the time left to the stage and the call; SIGINT at the limit, SIGKILL 30 s later.
step() {
    local name=$1 log=$2 cap=$3
    shift 3
    local left=$((STAGE_END < DEADLINE ? STAGE_END - SECONDS : DEADLINE - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 15)); then
        echo "== $name: not run, no time left" >>"$OUT/$log"
        note "$name: NOT RUN (no time left in this call)"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*" >>"$OUT/$log"
    echo "gpu_session: $name (limit ${limit}s) -> \$OUT/$log"
    if [[ $DRY == 1 ]]; then
        echo "   dry run: $*"
        note "$name: dry run"
        return 0
    fi
    local start=$SECONDS rc
    timeout --signal=INT --kill-after=30 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    echo "== $name: exit status $rc after ${took}s" >>"$OUT/$log"
    if ((rc == 124 || rc == 137)); then
        note "$name: CUT SHORT at its ${limit}s limit (exit $rc, ${took}s)"
    else
        note "$name: exit $rc, ${took}s"
    fi
    return 0
}

has_cuda() {
    [[ $DRY == 1 ]] && return 0
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}

# the last pytest line of a log ("3 failed, 40 passed in 55.2s") and its first FAILED / ERROR lines
pytest_summary() {
    local log=$OUT/$1
    [[ -f $log ]] || return 0
    note "  $(grep -E '(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$log" | tail -n 1)"
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^(FAILED|ERROR) ' "$log" | head -n 12)
}

stage_env() {
    local log=env.txt
    {
        echo "== date: $(date -u +%FT%TZ)   host: $(hostname)   kernel: $(uname -r)"
        echo "== nvidia-smi"
        nvidia-smi 2>&1 || echo "nvidia-smi: not found or failed"
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode,compute_mode,mig.mode.current --format=csv 2>&1
        nvidia-smi -q -d CLOCK,PERFORMANCE 2>&1 | head -n 60
        echo "== nvcc"
        nvcc --version 2>&1 | tail -n 2
        echo "== pip (selected)"
        "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|numpy|pytest|pytest-xdist|nvidia-cudnn|nvidia-cublas|onnx|onnxruntime|safetensors|setuptools|pip) '
    } >>"$OUT/$log" 2>&1
    step "environment probe" "$log" 120 "$PY" - <<'PYTHON'
import os, sys, time, traceback
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as error:
    print("triton: not importable:", error)
print("TF32 defaults: cuda.matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32,
      "cudnn.allow_tf32", torch.backends.cudnn.allow_tf32, "float32_matmul_precision", torch.get_float32_matmul_precision())
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"), "RNNKIT_TRITON_CUDA_GRAPHS", os.environ.get("RNNKIT_TRITON_CUDA_GRAPHS"))
try:
    import setuptools
    print("setuptools", setuptools.__version__, "(pyproject needs >= 77 for pip install -e; PYTHONPATH=src is used)")
except ImportError:
    print("setuptools: not installed (pip install -e cannot build; PYTHONPATH=src is used)")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
else:
    print("no CUDA device")
import rnnkit
print("rnnkit", rnnkit.__version__, "from", os.path.dirname(rnnkit.__file__))
for name, report in rnnkit.backends().items():
    print(f"  backend {name}: {report}")
if torch.cuda.is_available():
    from rnnkit.native import cudnn_report
    print("cudnn:", cudnn_report())
    from rnnkit.testing import rel_rms
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for backend, options in (("native", {}), ("triton", {"peephole": True, "layer_norm": True})):
        try:
            torch.manual_seed(0)
            m = rnnkit.LSTM(16, 32, num_layers=2, backend="reference", device="cuda", **options)
            x = torch.randn(10, 4, 16, device="cuda", requires_grad=True)
            y_ref, _ = m(x)
            (g_ref,) = torch.autograd.grad(y_ref.square().sum(), x)
            m.backend = backend
            start = time.perf_counter()
            y, _ = m(x)
            (g,) = torch.autograd.grad(y.square().sum(), x)
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            print(f"smoke {backend}: ran {m.last_backend}, y error {rel_rms(y, y_ref):.2e}, dx error "
                  f"{rel_rms(g, g_ref):.2e}, first call {took:.2f}s (kernel compiles, graph capture)")
        except Exception:
            print(f"smoke {backend}: FAILED")
            traceback.print_exc()
PYTHON
    step "pip install -e, dry run, offline" "$log" 90 "$PY" -m pip install --no-deps --no-build-isolation --no-index --dry-run -e .
    while IFS= read -r line; do note "  $line"; done < <(grep -E '^(torch |triton |GPU |no CUDA|rnnkit |smoke |TF32 |setuptools|cudnn:)' "$OUT/$log")
    note "  driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
}

stage_tests() {
    export TRITON_INTERPRET=0 # tests/conftest.py sets it to 1 unless it is set
    unset RNNKIT_TRITON_INTERPRET
    local pytest=("$PY" -m pytest -q -ra -p no:cacheprovider --durations=5)
    step "test_gpu.py" tests-gpu.log 120 "${pytest[@]}" tests/test_gpu.py
    pytest_summary tests-gpu.log
    # PYTEST_WORKERS=N: test_triton.py in N processes (pytest-xdist; the kernels' compiles are CPU-bound)
    local workers=()
    [[ -n ${PYTEST_WORKERS:-} ]] && "$PY" -c "import xdist" 2>/dev/null && workers=(-n "$PYTEST_WORKERS")
    step "test_triton.py on cuda, CUDA graphs on" tests-triton-graphs.log 180 \
        env RNNKIT_TEST_TRITON_DEVICE=cuda RNNKIT_TRITON_CUDA_GRAPHS=1 "${pytest[@]}" "${workers[@]}" tests/test_triton.py
    pytest_summary tests-triton-graphs.log
    step "test_triton.py on cuda, CUDA graphs off" tests-triton-eager.log 120 \
        env RNNKIT_TEST_TRITON_DEVICE=cuda RNNKIT_TRITON_CUDA_GRAPHS=0 "${pytest[@]}" "${workers[@]}" tests/test_triton.py
    pytest_summary tests-triton-eager.log
}

stage_correct() {
    export TRITON_INTERPRET=0
    unset RNNKIT_TRITON_INTERPRET
    step "gpu_correctness.py (CUDA graphs on)" correct.log 360 \
        env RNNKIT_TRITON_CUDA_GRAPHS=1 "$PY" benchmarks/gpu_correctness.py --device cuda
    correct_summary correct.log
    step "gpu_correctness.py, training cases, float32, CUDA graphs off" correct-eager.log 90 \
        env RNNKIT_TRITON_CUDA_GRAPHS=0 "$PY" benchmarks/gpu_correctness.py --device cuda --filter train --dtypes float32
    correct_summary correct-eager.log
    step "gpu_correctness.py, training and wide cases, the Triton per-step GEMM" correct-step-gemm.log 90 \
        env RNNKIT_TRITON_STEP_GEMM=triton "$PY" benchmarks/gpu_correctness.py --device cuda --filter train \
        --filter wide --dtypes float32 bfloat16
    correct_summary correct-step-gemm.log
    step "gpu_correctness.py, bfloat16 / float16, the half dtype's own GEMM operands" correct-half-gemm.log 90 \
        env RNNKIT_TRITON_HALF_GEMM=half "$PY" benchmarks/gpu_correctness.py --device cuda --dtypes bfloat16 float16
    correct_summary correct-half-gemm.log
}

correct_summary() {
    local log=$OUT/$1
    [[ -f $log ]] || return 0
    note "  $(grep -E '^gpu_correctness: [0-9]+/' "$log" | tail -n 1 | cut -c1-300)"
    note "  cases done: $(grep -cE '^(PASS|FAIL) ' "$log")"
    while IFS= read -r line; do note "  ${line:0:240}"; done < <(grep -E '^FAIL ' "$log" | head -n 15)
}

# the GPU grid (BENCH.md) in parts: a PART is one of these groups or one shape of the grid
declare -A BENCH_GROUPS=(
    [cpu-grid]="stream small medium fastrnns wide"
    [deepbench]="deepbench-h512-b16 deepbench-h512-b32 deepbench-h512-b64 deepbench-h1024-b16 deepbench-h1024-b32 deepbench-h1024-b64 deepbench-h2048-b16 deepbench-h2048-b32 deepbench-h2048-b64"
    [long]="long-h768"
)
declare -A BENCH_CAPS=([cpu-grid]=270 [deepbench]=200 [long]=480) # seconds; a single shape: 240
PART_PATTERN="^(cpu-grid|deepbench|long|stream|small|medium|fastrnns|wide|deepbench-h(512|1024|2048)-b(16|32|64)|long-h768)$"

# bench DTYPE PART...: rnnkit bench on the parts (default the three groups), in order, as time allows
stage_bench() {
    local dtype=$1
    shift
    local parts=("$@")
    ((${#parts[@]})) || parts=(cpu-grid deepbench long)
    local log=bench-$dtype.log
    # float32: TF32 off for cuBLAS and cuDNN, so every runner computes float32 (and passes 1e-5)
    local bench=("$PY" -m rnnkit bench)
    if [[ $dtype == float32 ]]; then
        bench=("$PY" -c 'import sys, torch
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
from rnnkit.app.bench import main
sys.exit(main(sys.argv[1:]))')
    fi
    local part shapes specs=()
    for part in "${parts[@]}"; do
        shapes=${BENCH_GROUPS[$part]:-$part}
        rm -rf "$SCRATCH/bench-$dtype-$part"
        # shellcheck disable=SC2086  # the shapes are one word each
        step "bench $dtype $part" "$log" "${BENCH_CAPS[$part]:-240}" "${bench[@]}" --device cuda --dtype "$dtype" \
            --runners torch.nn native triton --modes inference training --shapes $shapes \
            --out "$SCRATCH/bench-$dtype-$part" ${BENCH_EXTRA:-}
        specs+=("bench-$dtype-$part=${shapes// /,}")
    done
    [[ $DRY == 1 ]] && return 0
    local existing=()
    for part in "${parts[@]}"; do [[ -d $SCRATCH/bench-$dtype-$part ]] && existing+=("bench-$dtype-$part"); done
    if ((${#existing[@]})); then
        tar -czf "$OUT/bench-$dtype.tar.gz" -C "$SCRATCH" "${existing[@]}"
        for part in "${existing[@]}"; do
            [[ -f $SCRATCH/$part/bench.md ]] && { echo "# $part"; cat "$SCRATCH/$part/bench.md"; echo; }
        done >"$OUT/bench-$dtype.md"
    fi
    "$PY" - "$SCRATCH" "$STAGE" "${specs[@]}" >"$OUT/bench-$dtype-summary.txt" 2>&1 <<'PYTHON'
import json, os, sys
from rnnkit.app.bench.registry import DEFAULT_VARIANTS
scratch, stage, specs = sys.argv[1], sys.argv[2], [s.split("=") for s in sys.argv[3:]]
per_shape = len(DEFAULT_VARIANTS) * 2  # every sequence variant, inference and training
left = []
for part, shapes in specs:
    shapes = shapes.split(",")
    try:
        with open(os.path.join(scratch, part, "bench.json")) as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        print(f"{part}: no results ({type(error).__name__}: {error})")
        left += shapes
        continue
    records, env = data["records"], data["environment"]
    done = {(r["shape"], r["variant"], r["mode"]) for r in records}
    left += [s for s in shapes if sum(1 for d in done if d[0] == s) < per_shape]
    print(f"{part}: {len(done)} of {len(shapes) * per_shape} shape x variant x mode; {env.get('device_name')}, "
          f"torch {env.get('torch')}, sgemm {env.get('sgemm_gflops', 0):.0f} GFLOP/s")
    for r in records:
        if r["status"] == "failed":
            print(f"  FAILED {r['runner']} {r['shape']}/{r['variant']}/{r['mode']}: {r.get('reason', '')[:200]}")
    for runner in ("native", "triton"):
        rows, plain = {}, {}  # issue 16's targets: plain <= 1.02x cuDNN; a variant <= 1.3x cuDNN's plain LSTM
        for r in records:
            if r["runner"] == runner and r["status"] == "ok" and r.get("speedup_vs_torch_nn"):
                rows.setdefault((r["variant"], r["mode"]), []).append(1 / r["speedup_vs_torch_nn"])
            if r["runner"] == runner and "time_vs_torch_nn_plain_lstm" in r:
                plain.setdefault((r["variant"], r["mode"]), []).append(r["time_vs_torch_nn_plain_lstm"])
        for (variant, mode), ratios in sorted(rows.items()):
            extra = plain.get((variant, mode))
            extra = f"; / plain LSTM {min(extra):.2f}-{max(extra):.2f}" if extra else ""
            print(f"  {runner:6s} {variant:17s} {mode:9s} time / torch.nn {min(ratios):.2f}-{max(ratios):.2f} "
                  f"over {len(ratios)} shapes{extra}")
if left:
    print(f"to finish: bash benchmarks/gpu_session.sh {stage} {' '.join(left)}")
PYTHON
    while IFS= read -r line; do note "  ${line:0:240}"; done < <(head -n 60 "$OUT/bench-$dtype-summary.txt")
}

stage_profile() {
    export TRITON_INTERPRET=0
    unset RNNKIT_TRITON_INTERPRET
    step "gpu_profile.py (where a call's time goes)" profile.txt 110 "$PY" benchmarks/gpu_profile.py --top 6
    step "gpu_profile.py, bfloat16, the half dtype's own GEMM operands" profile.txt 60 "$PY" benchmarks/gpu_profile.py \
        --dtype bfloat16 --ab RNNKIT_TRITON_HALF_GEMM=half --shapes deepbench-h2048-b32 deepbench-h512-b32 \
        --variants lstm lstm_layer_norm --top 6
    while IFS= read -r line; do note "  ${line:0:240}"; done < <(grep -E '^(gpu_profile|shape|small|deepbench)' "$OUT/profile.txt" | head -n 14)
}

stage_train() {
    # issue 16, step 6: the char LM on CUDA, default config on cuDNN (native) and with layer norm on triton
    local run
    for run in "native" "triton --layer-norm"; do
        # shellcheck disable=SC2086  # the flags are words
        step "rnnkit train --device cuda --backend $run" train.txt 120 "$PY" -m rnnkit train --device cuda \
            --backend $run --out "$SCRATCH/train-${run%% *}"
        note "  $run: $(grep -E '^rnnkit: step [0-9]+: validation' "$OUT/train.txt" | tail -n 1)"
    done
}

stage_suite() {
    local workers=()
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n 8)
    step "the whole suite" suite.log 480 "$PY" -m pytest -q -ra -p no:cacheprovider "${workers[@]}" tests
    pytest_summary suite.log
}

(($#)) || {
    echo "usage: bash benchmarks/gpu_session.sh STAGE [ARG ...] [STAGE ...]; stages: env tests correct profile train bench-fp32 [PART ...] bench-bf16 [PART ...] suite" >&2
    exit 2
}
while (($#)); do
    stage=$1
    STAGE=$stage
    shift
    args=()
    while (($#)) && [[ $1 =~ $PART_PATTERN ]]; do
        args+=("$1")
        shift
    done
    note "[$stage${args[*]:+ ${args[*]}}]"
    if [[ $stage != env ]] && ! has_cuda; then
        note "  not run: no CUDA device here (torch.cuda.is_available() is False)"
        continue
    fi
    STAGE_END=$((SECONDS + 510))
    case $stage in
    env) STAGE_END=$((SECONDS + 150)) && stage_env ;;
    tests) stage_tests ;;
    correct) stage_correct ;;
    bench-fp32) stage_bench float32 "${args[@]}" ;;
    bench-bf16) stage_bench bfloat16 "${args[@]}" ;;
    suite) stage_suite ;;
    profile) stage_profile ;;
    train) stage_train ;;
    *) note "  unknown stage '$stage' (env tests correct profile train bench-fp32 bench-bf16 suite)" ;;
    esac
done

printf '%s\n' "${SUMMARY[@]}" >"$OUT/summary.txt"
echo
echo "== gpu_session summary ($((SECONDS))s; files in \$OUT: $(ls "$OUT" | tr '\n' ' '))"
printf '%s\n' "${SUMMARY[@]}"
