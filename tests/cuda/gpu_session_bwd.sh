#!/usr/bin/env bash
# One device call for the CUDA backward: standalone build, SASS check, correctness,
# timing (backward + forward), compute-sanitizer, Python build + GPU pytest.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_bwd.sh [steps...]
#   steps default: build sass corr timing fwd memcheck racecheck pytest
#   MEMCHECK_CASE, RACECHECK_CASE: harness cases of the sanitizer steps (odd_dims, tiny)
set -uo pipefail
out="${OUT:-/tmp/mok_bwd_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B=/tmp/mok_bwd_build
steps="${*:-build sass corr timing fwd memcheck racecheck pytest}"
source "$(dirname "$0")/session_common.sh"
if has build; then
  step build 240 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run_backward.sh || { tail -40 "$out/build.log"; }
fi
if has sass; then
  { echo "HGMMA per kernel (gemm_wgmma_bwd.o):";
    cuobjdump --dump-sass $B/lib/gemm_wgmma_bwd.o | awk '/Function :/{f=$3} /HGMMA/{c[f]++} END{for(k in c) print c[k], k}';
    echo "HGMMA total forward gemm_wgmma.o: $(cuobjdump --dump-sass $B/lib/gemm_wgmma.o | grep -c HGMMA)";
    echo "LDL/STL in bwd: $(cuobjdump --dump-sass $B/lib/gemm_wgmma_bwd.o | grep -cE 'LDL|STL')";
    grep -h -B1 -A3 "bwd_gemm_kernel" $B/gemm_wgmma_bwd.ptxas.txt | grep -E "registers|spill|smem" ; } > "$out/sass.txt" 2>&1
fi
has corr && step corr 90 $B/backward_standalone --correctness
has timing && step timing 90 $B/backward_standalone --timing --iters 30
has timing_shared && step timing_sh 180 $B/backward_standalone --timing-shared --iters 20
has fwd && step fwd 60 $B/forward_standalone --timing --iters 20
has memcheck && step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 9 $B/backward_standalone --case "${MEMCHECK_CASE:-odd_dims}"
has racecheck && step racecheck 60 compute-sanitizer --tool racecheck --error-exitcode 9 $B/backward_standalone --case "${RACECHECK_CASE:-tiny}"
has pytest && pytest_step 130 -x -k "backward or gradients"
echo "================ summary"
cat "$out/gpu.txt" 2>/dev/null
cat "$out/sass.txt" 2>/dev/null
[ -f "$out/corr.log" ] && grep -E "FAIL|correctness:" "$out/corr.log" | cut -c1-260
[ -f "$out/timing.log" ] && grep -E "median|prep|bench|TFLOP" "$out/timing.log" | cut -c1-260
[ -f "$out/timing_sh.log" ] && grep -E "median|prep|incl" "$out/timing_sh.log" | cut -c1-260
[ -f "$out/fwd.log" ] && grep -E "total|schedule|correctness:" "$out/fwd.log" | cut -c1-200
[ -f "$out/memcheck.log" ] && grep -E "ERROR SUMMARY|RESULT" "$out/memcheck.log"
[ -f "$out/racecheck.log" ] && grep -E "RACECHECK SUMMARY|ERROR SUMMARY|RESULT" "$out/racecheck.log"
[ -f "$out/pytest.log" ] && grep -E "passed|failed|Error" "$out/pytest.log" | tail -8
printf '%s\n' "${summary[@]}"
