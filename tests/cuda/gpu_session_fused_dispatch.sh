#!/usr/bin/env bash
# One device call for the dispatch fused into the gate/up GEMM
# (ffi/dispatch_fused.cuh, MOK_CUDA_FUSED_DISPATCH=1) against the separate
# dispatch kernel: standalone build, SASS check, the staged correctness cases
# and memcheck with the fused copy, then alternated timings per shape of the
# inference forward (no residuals: cooperative gate/up either way) and the
# training forward (default: ping-pong gate/up where it applies; "coop": the
# cooperative kernel with the separate dispatch, MOK_CUDA_GEMM_PINGPONG=0).
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_fused_dispatch.sh [steps...]
#   steps default: build sass corr memcheck timing (memcheck after shape 1's timings)
#   SHAPES: timing shapes (default: benchmark shapes 1, 4 and 2)
set -uo pipefail
final="${OUT:-/tmp/mok_fused_out}"
out="${LOGS:-/tmp/mok_fused_logs}"
mkdir -p "$out" "$final"
steps="${*:-build sass corr memcheck timing}"
source "$(dirname "$0")/session_common.sh"
B=/tmp/mok_fused_build
FS=$B/forward_standalone
F=MOK_CUDA_FUSED_DISPATCH=1
collect() { for f in "$out"/*; do echo "=================== $(basename "$f")"; cat "$f"; done > "$final/all_logs.txt" 2>&1; }
if has build; then
  step build 300 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run.sh || tail -40 "$out/build.log"
fi
if has sass; then
  cuobjdump --dump-sass $B/gemm_wgmma.o | awk '/Function :/{f=$3} /HGMMA/{c[f]++} /LDL|STL/{l[f]++}
    END{for(k in c) print c[k]" HGMMA, "l[k]+0" LDL/STL  "substr(k,1,100)}' > "$out/sass.txt" 2>&1
fi
has corr && step corr_fused 200 env $F $FS --correctness --staged
collect
if has timing; then
  for s in ${SHAPES:-32768,2048,768,128,8 8192,4096,14336,8,2 32768,4096,1024,128,8}; do
    n=$(echo "$s" | cut -d, -f1-3 | tr , x)
    run() {  # run TAG ENV... -- [args]: one staged timing
      local tag="$1"; shift
      local e=()
      while [ "$1" != "--" ]; do e+=("$1"); shift; done
      shift
      step "t_${n}_$tag" 120 env "${e[@]}" $FS --timing --iters 20 --staged --shape "$s" "$@"
    }
    run inf_base X=0 -- --no-residuals --no-check
    run inf_fused $F -- --no-residuals
    run train_base X=0 -- --no-check
    run train_fused $F -- --no-check
    if [ "$n" = "32768x2048x768" ]; then  # shape 1: training gate/up on ping-pong by default
      run train_coop MOK_CUDA_GEMM_PINGPONG=0 -- --no-check
      run train_fused_coop $F MOK_CUDA_GEMM_PINGPONG=0 -- --no-check
    fi
    run inf_fused2 $F -- --no-residuals --no-check
    run inf_base2 X=0 -- --no-residuals --no-check
    run train_fused2 $F -- 
    run train_base2 X=0 -- --no-check
    collect
    [ "$n" = "32768x2048x768" ] && has memcheck && { step memcheck_fused 150 env $F compute-sanitizer --tool memcheck --error-exitcode 9 $FS --case odd_dims --staged; collect; }
  done
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in corr_fused; do [ -f "$out/$f.log" ] && grep -E "FAIL|correctness" "$out/$f.log" | cut -c1-200; done
[ -f "$out/memcheck_fused.log" ] && grep -E "ERROR SUMMARY" "$out/memcheck_fused.log"
for f in "$out"/t_*.log; do
  [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "total   median" "$f" | cut -c1-60) | $(grep -E "dispatch|gate/up" "$f" | head -1 | cut -c1-130) $(grep -E "determinism: BAD|FAIL|error" "$f" | head -1)"
done
printf '%s\n' "${summary[@]}"
collect
