#!/usr/bin/env bash
# One device call for the dispatch fused into the gate/up GEMM
# (ffi/dispatch_fused.cuh: the default in the forward that keeps no residuals,
# MOK_CUDA_FUSED_DISPATCH=1 everywhere, =0 nowhere) against the separate
# dispatch kernel: standalone build, SASS check, the staged correctness cases
# and memcheck with the fused copy, then alternated timings per shape of the
# inference forward (no residuals: cooperative gate/up either way) and the
# training forward (default: ping-pong gate/up where it applies; "coop": the
# cooperative kernel with the separate dispatch, MOK_CUDA_GEMM_PINGPONG=0).
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_fused_dispatch.sh [steps...]
#   steps default: build sass corr memcheck timing (memcheck after shape 1's timings)
#   SHAPES: timing shapes (default: benchmark shapes 1, 2 and 4)
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
# the row-major dispatch kernel shares copy_row_warp with the fused copy
has corr && step corr_rows 200 env MOK_CUDA_DISPATCH=rows $FS --correctness --staged
collect
# VARIANTS: ';'-separated "tag ENV=V ... -- harness args" (run in this order,
# then again in reverse order: tag2); default: on the inference forward the
# separate dispatch, the fused copy with its default 8 MB window (the default
# there since the twenty-fourth session), no throttle, and a 4 MB window (the
# window is at least 4 tiles: 4 MB at H = 4096); on the training forward the
# ping-pong default (separate dispatch), the cooperative kernel, and both
# kernels fused with the default window (the training forward measured fused
# only without a window so far).
S=MOK_CUDA_FUSED_DISPATCH=0
W=MOK_CUDA_FUSED_DISPATCH_WINDOW_MB
V_DEF="inf_sep $S -- --no-residuals;inf_fused_w8 X=0 -- --no-residuals;inf_fused_w0 $W=0 -- --no-residuals"
V_DEF+=";inf_fused_w4 $W=4 -- --no-residuals"
V_DEF+=";train_base X=0 --;train_coop MOK_CUDA_GEMM_PINGPONG=0 --;train_fused_coop $F MOK_CUDA_GEMM_PINGPONG=0 --"
V_DEF+=";train_fused_pp $F --"
if has timing; then
  IFS=';' read -ra vars <<< "${VARIANTS:-$V_DEF}"
  for s in ${SHAPES:-32768,2048,768,128,8 32768,4096,1024,128,8 8192,4096,14336,8,2}; do
    n=$(echo "$s" | cut -d, -f1-3 | tr , x)
    for pass in 1 2; do
      order=("${vars[@]}")
      [ $pass = 2 ] && order=($(for ((i=${#vars[@]}-1; i>=0; i--)); do echo "${vars[$i]// /@}"; done))
      for v in "${order[@]}"; do
        v="${v//@/ }"
        read -ra w <<< "$v"
        tag="${w[0]}"; e=(); i=1
        while [ "${w[$i]}" != "--" ]; do e+=("${w[$i]}"); i=$((i + 1)); done
        args=("${w[@]:$((i + 1))}")
        # the sampled check at this shape on the first pass only
        [ $pass = 1 ] || args+=(--no-check)
        step "t_${n}_${tag}$([ $pass = 2 ] && echo 2)" 120 env "${e[@]}" $FS --timing --iters 20 --staged --shape "$s" "${args[@]}"
      done
      collect
    done
    [ "$n" = "32768x2048x768" ] && has memcheck && { step memcheck_fused 150 env $F compute-sanitizer --tool memcheck --error-exitcode 9 $FS --case odd_dims --staged; collect; }
  done
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in corr_fused corr_rows; do [ -f "$out/$f.log" ] && grep -E "FAIL|correctness" "$out/$f.log" | cut -c1-200; done
[ -f "$out/memcheck_fused.log" ] && grep -E "ERROR SUMMARY" "$out/memcheck_fused.log"
for f in "$out"/t_*.log; do
  [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "total   median" "$f" | awk '{print $3}') ms | $(grep -E "^  schedule" "$f" | head -1 | sed 's/^ *schedule [0-9.]* ms | //' | cut -c1-110) $(grep -E "determinism: BAD|FAIL|rror" "$f" | head -1)"
done
printf '%s\n' "${summary[@]}" | grep -v "rc=0 "
collect
