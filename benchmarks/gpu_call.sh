#!/usr/bin/env bash
# Issue 16 in ONE device call, for a lease of 15 minutes: bash benchmarks/gpu_call.sh [BENCH PART ...]
#
# env first; then the `tests` and `correct` stages of gpu_session.sh side by side (their work is
# mostly Triton's CPU-bound compiles and small GPU launches; test_triton.py in PYTEST_WORKERS
# processes, default 4); then `profile` (benchmarks/gpu_profile.py) and `bench-fp32` on the PARTs
# (default: what the 2026-11-28 runs left: medium, DeepBench H 1024 B 64, stream, fastrnns, wide, the
# other DeepBench shapes; small and long-h768 are in benchmarks/results/2026-11-28v-*) alone on the GPU for what is
# left of GPU_CALL_LIMIT_S (default 540 s; GPU_CALL_PROFILE=0 skips the profile, GPU_CALL_TRAIN=1 adds
# `train`, the char LM on CUDA, before the bench).
# Run twice on 2026-11-28 on an H200 (README, "GPU"): ~30 s to start and copy, 506-510 s of command
# (env 12 s; tests and correct side by side 184 s; profile 27 s; the bench the rest). Since then
# `correct` and `profile` also run the Triton per-step GEMM and the half dtypes' own GEMM operands
# (RNNKIT_TRITON_STEP_GEMM, RNNKIT_TRITON_HALF_GEMM; never run on a GPU): expect ~300 s side by side
# and ~2 min of profile, so the bench gets little; its parts then go in a second call,
# `GPU_SESSION_LIMIT_S=... bash benchmarks/gpu_session.sh bench-fp32 PART ...`.
# Every log goes into $OUT/logs.tar.gz (one folder per stage), the bench table into
# $OUT/bench-float32.md, the stages' summaries into $OUT/summary.txt, printed last.
# Locally: GPU_SESSION_DRY_RUN=1 OUT=/tmp/x bash benchmarks/gpu_call.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
FINAL=${OUT:?set OUT to the folder that comes back}
LIMIT=${GPU_CALL_LIMIT_S:-540}
SIDE=${GPU_CALL_SIDE_S:-300}  # tests and correct, side by side
START=$SECONDS
W=${TMPDIR:-/tmp}/rnnkit-gpu-call
rm -rf "$W" && mkdir -p "$W/1-env" "$W/2-tests" "$W/3-correct" "$W/5-bench"
export PYTEST_WORKERS=${PYTEST_WORKERS:-4}
parts=("$@")
((${#parts[@]})) || parts=(medium deepbench-h1024-b64 stream fastrnns wide deepbench-h512-b16 deepbench-h2048-b64)

OUT=$W/1-env GPU_SESSION_LIMIT_S=100 bash benchmarks/gpu_session.sh env >"$W/1-env/stdout.txt" 2>&1
OUT=$W/2-tests GPU_SESSION_LIMIT_S=$SIDE bash benchmarks/gpu_session.sh tests >"$W/2-tests/stdout.txt" 2>&1 &
OUT=$W/3-correct GPU_SESSION_LIMIT_S=$SIDE bash benchmarks/gpu_session.sh correct >"$W/3-correct/stdout.txt" 2>&1 &
wait
mkdir -p "$W/4-profile"
[[ ${GPU_CALL_PROFILE:-1} == 1 ]] &&
    OUT=$W/4-profile GPU_SESSION_LIMIT_S=170 bash benchmarks/gpu_session.sh profile >"$W/4-profile/stdout.txt" 2>&1
[[ ${GPU_CALL_TRAIN:-0} == 1 ]] && mkdir -p "$W/4-train" &&
    OUT=$W/4-train GPU_SESSION_LIMIT_S=150 bash benchmarks/gpu_session.sh train >"$W/4-train/stdout.txt" 2>&1
left=$((LIMIT - (SECONDS - START) - 20))
OUT=$W/5-bench GPU_SESSION_LIMIT_S=$left bash benchmarks/gpu_session.sh bench-fp32 "${parts[@]}" >"$W/5-bench/stdout.txt" 2>&1

tar -czf "$FINAL/logs.tar.gz" -C "$W" .
cat "$W"/*/summary.txt >"$FINAL/summary.txt" 2>/dev/null
cp "$W/5-bench/bench-float32.md" "$FINAL/" 2>/dev/null
echo "== gpu_call: $((SECONDS - START))s"
cat "$FINAL/summary.txt"
