#!/usr/bin/env bash
# One device call for the gate/up GEMM that gathers its rows from x
# (gemm_wgmma.cu, kGather; the default) against the dispatch copy it replaces
# (MOK_CUDA_FUSED_GATHER=0): build, SASS check, staged-forward correctness
# both ways and with single-CTA launches, compute-sanitizer on a small case,
# alternated harness timings (A B B A) at $SHAPES (with the pre-activations
# kept, as in training, and shape 1 without them, as in inference), then the
# through-JAX benchmark alternated the same way (steps jax, jaxtorch).
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_gather.sh [steps...]
#   steps default: build sass corr memcheck racecheck synccheck ftiming jax
set -uo pipefail
final="${OUT:-/tmp/mok_gather_out}"
out="${LOGS:-/tmp/mok_gather_logs}"
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
steps="${*:-build sass corr memcheck racecheck synccheck ftiming jax}"
has_jax=""; [[ " $steps " == *" jax"* ]] && has_jax=1
NEED_PY=$has_jax source "$(dirname "$0")/session_common.sh"
B=/tmp/mok_gather_build
FS=$B/forward_standalone
collect() {  # every log into one file after each step: the device tool returns few files
  for f in "$out"/*; do echo "=================== $(basename "$f")"; cat "$f"; done > "$final/all_logs.txt" 2>&1
}
if has build; then
  step build 240 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run_backward.sh
  collect
fi
if has sass; then
  cuobjdump --dump-sass $B/lib/gemm_wgmma.o | awk '/Function :/{f=$3} /HGMMA/{c[f]++} /LDGSTS/{g[f]++} /LDL|STL/{l[f]++}
    END{for(k in c) print c[k]" HGMMA, "g[k]+0" LDGSTS, "l[k]+0" LDL/STL  "substr(k,1,110)}' > "$out/sass.txt" 2>&1
  collect
fi
if has corr; then
  step corr_gather 200 $FS --correctness --staged
  step corr_copy 200 env MOK_CUDA_FUSED_GATHER=0 $FS --correctness --staged
  step corr_c1 200 env MOK_CUDA_GEMM_CLUSTER=1 $FS --correctness --staged
  collect
fi
for tool in memcheck racecheck synccheck; do
  has $tool && step $tool 120 compute-sanitizer --tool $tool --error-exitcode 9 $FS --case odd_dims --staged
done
collect
SHAPES="${SHAPES:-32768,2048,768,128,8 32768,4096,1024,128,8 4096,7168,2048,32,8 8192,4096,14336,8,2}"
if has ftiming; then
  i=0
  for sh in $SHAPES; do
    i=$((i + 1)); n=0
    for v in 1 0 0 1; do
      n=$((n + 1))
      step "f_s${i}_${n}_g$v" 90 env MOK_CUDA_FUSED_GATHER=$v $FS --timing --iters 20 --staged --no-check --shape "$sh"
    done
  done
  n=0
  for v in 1 0 0 1; do
    n=$((n + 1))
    step "f_s1inf_${n}_g$v" 90 env MOK_CUDA_FUSED_GATHER=$v $FS --timing --iters 20 --staged --no-check --no-residuals
  done
  collect
fi
if [ -n "$has_jax" ]; then
  wait_pip
  n=0
  for v in 1 0 1 0; do
    n=$((n + 1)); impls=cuda
    has jaxtorch && [ $n = 1 ] && impls=cuda,torch
    step "jax_${n}_g$v" 150 env MOK_CUDA_FUSED_GATHER=$v python3 -m benchmarks.run --out "$final/jax_$n" --tag gpu \
      --shapes 1,2,3,4 --impls $impls --passes fwd,fwd+bwd --sweep '' --iters 10 --no-memory --no-plots
  done
  collect
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in corr_gather corr_copy corr_c1; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "FAIL|correctness:" "$out/$f.log" | cut -c1-200 | tail -4; }; done
for f in memcheck racecheck synccheck; do [ -f "$out/$f.log" ] && echo "-- $f: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out/$f.log" | tr '\n' ' ')"; done
for f in "$out"/f_s*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "total   median" "$f" | sed -E 's/\(min.*//' | tr -s ' ') | $(grep -E "gate/up" "$f" | tr -s ' ' | cut -c1-150)"; done
for f in "$out"/jax_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; grep -E "^\| [a-z0-9]" "$f" | grep -v "^| shape" | awk -F'|' '{print $2"|"$5"|"$6"|"$7"|"$8}' | tr -s ' '; }; done
printf '%s\n' "${summary[@]}"
collect
