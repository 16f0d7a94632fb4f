#!/usr/bin/env bash
# One device call for the ping-pong GEMMs (ffi/gemm_wgmma_pingpong.cu: the
# forward's two; ffi/gemm_wgmma_bwd_pingpong.cu: the backward's dgrad-down +
# SwiGLU) against the cooperative kernels they replace (MOK_CUDA_GEMM_PINGPONG=0,
# MOK_CUDA_BWD_PINGPONG=0): build, SASS check, correctness (forward: every staged
# harness case; backward: every case, bitwise against the backward megakernel,
# and the cooperative kernels on the small cases), compute-sanitizer on small
# cases, alternated timings (A B B A) of both harnesses at $SHAPES.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_pingpong.sh [steps...]
#   steps default: build sass corr memcheck racecheck ftiming timing
set -uo pipefail
final="${OUT:-/tmp/mok_pp_out}"
out="${LOGS:-/tmp/mok_pp_logs}"
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1
steps="${*:-build sass corr memcheck racecheck ftiming timing}"
source "$(dirname "$0")/session_common.sh"
PP="env MOK_CUDA_GEMM_PINGPONG=1 MOK_CUDA_BWD_PINGPONG=1"  # the kernels under test (off by default until measured)
B=/tmp/mok_pp_build
collect() {  # every log into one file after each step: the device tool returns few files
  for f in "$out"/*; do echo "=================== $(basename "$f")"; cat "$f"; done > "$final/all_logs.txt" 2>&1
}
if has build; then
  step build 240 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run_backward.sh
  collect
fi
if has sass; then
  for o in gemm_wgmma_pingpong gemm_wgmma_bwd_pingpong; do cuobjdump --dump-sass $B/lib/$o.o | awk '/Function :/{f=$3} /HGMMA/{c[f]++} /LDL|STL/{l[f]++}
    END{for(k in c) print "ping-pong: "c[k]" HGMMA, "l[k]+0" LDL/STL  "substr(k,1,90)}'; done > "$out/sass.txt" 2>&1
  collect
fi
if has corr; then
  step fcorr 200 $PP $B/forward_standalone --correctness --staged
  step corr 300 $PP $B/backward_standalone --correctness --megakernel
  step corr_coop 120 env MOK_CUDA_GEMM_PINGPONG=0 MOK_CUDA_BWD_PINGPONG=0 $B/backward_standalone --correctness --small
  collect
fi
has memcheck && step memcheck 120 $PP compute-sanitizer --tool memcheck --error-exitcode 9 $B/backward_standalone --case odd_dims
has racecheck && step racecheck 120 $PP compute-sanitizer --tool racecheck --error-exitcode 9 $B/backward_standalone --case tiny
has synccheck && step synccheck 120 $PP compute-sanitizer --tool synccheck --error-exitcode 9 $B/backward_standalone --case tiny
collect
SHAPES="${SHAPES:-32768,2048,768,128,8 32768,4096,1024,128,8 4096,7168,2048,32,8 8192,4096,14336,8,2}"
if has ftiming; then
  i=0
  for sh in $SHAPES; do
    i=$((i + 1)); n=0
    for v in 1 0 0 1; do
      n=$((n + 1))
      step "f_s${i}_${n}_pp$v" 90 env MOK_CUDA_GEMM_PINGPONG=$v $B/forward_standalone --timing --iters 20 --staged --no-check --shape "$sh"
    done
  done
  collect
fi
if has timing; then
  i=0
  for sh in $SHAPES; do
    i=$((i + 1)); n=0
    for v in 1 0 0 1; do
      n=$((n + 1))
      step "t_s${i}_${n}_pp$v" 120 env MOK_CUDA_GEMM_PINGPONG=$v MOK_CUDA_BWD_PINGPONG=$v $B/backward_standalone --timing --iters 20 --no-check --shape "$sh"
    done
    collect
  done
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in fcorr corr corr_coop; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "FAIL|DIFFERS|correctness:" "$out/$f.log" | cut -c1-200 | tail -4; }; done
for f in memcheck racecheck synccheck; do [ -f "$out/$f.log" ] && echo "-- $f: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$f.log" | tr '\n' ' ')"; done
for f in "$out"/f_s*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "total   median" "$f" | sed -E 's/\(min.*//' | tr -s ' ') | $(grep -E "gate/up" "$f" | sed -E 's/.*gate\/up/gate\/up/; s/\| combine.*//' | tr -s ' ')"; done
for f in "$out"/t_s*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "backward median" "$f" | sed -E 's/\(min.*//' | tr -s ' ') | $(grep -E "prep" "$f" | tr -s ' ' | cut -c1-170)"; done
printf '%s\n' "${summary[@]}"
collect
