#!/usr/bin/env bash
# One device call for the staged GEMMs' consumer stagger (gemm_tile.cuh,
# tile::stagger_tile; run-time knob MOK_CUDA_GEMM_STAGGER = 0..3 k blocks):
# one build of both harnesses, SASS check (HGMMA and named-barrier instructions
# per kernel), correctness with the stagger on (forward staged cases against
# the fp64 reference; backward cases also bitwise against the megakernel,
# which never staggers), compute-sanitizer on the stagger case, then timing
# of the staged forward (shapes 1-4) and backward (harness shape 1) for each
# stagger (0 against 2 twice, alternated; then 1 and 3 at shapes 1 and 4).
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_stagger.sh [steps...]
#   steps default: build corr timing sass sanitize (the order they run in: a
#   call stopped at its limit has the A/B first)
set -uo pipefail
# Logs go to $LOGS; $OUT gets them as one file (all_logs.txt, rewritten after
# every phase, so a call stopped at its limit still brings back what ran) and
# summary.txt: the device tool brings back only a few files.
final="${OUT:-/tmp/mok_stagger_out}"
out="${LOGS:-/tmp/mok_stagger_logs}"
mkdir -p "$out" "$final"
steps="${*:-build corr timing sass sanitize}"
source "$(dirname "$0")/session_common.sh"
collect() { for f in "$out"/*.log "$out"/*.txt; do [ -f "$f" ] && { echo "=== $(basename "$f")"; cat "$f"; }; done > "$final/all_logs.txt" 2>&1; }
B=/tmp/stg
FS=$B/forward_standalone
BS=$B/backward_standalone
S=MOK_CUDA_GEMM_STAGGER
if has build; then
  step build 300 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run_backward.sh || tail -30 "$out/build.log"
fi
collect
if has corr; then
  step corr_fwd2 200 env $S=2 $FS --correctness --staged
  step corr_bwd2 300 env $S=2 $BS --correctness --megakernel
  for g in 1 3; do
    step corr_fwd$g 60 env $S=$g $FS --case stagger_k --staged
    step corr_bwd$g 90 env $S=$g $BS --case stagger_k --megakernel
  done
fi
collect
SHAPES=("" "32768,2048,768,128,8" "32768,4096,1024,128,8" "4096,7168,2048,32,8" "8192,4096,14336,8,2")
# timing_pass TAG "STAGGERS" "SHAPES": the staged forward at each shape, then
# the backward (harness shape 1), for each stagger in turn.
timing_pass() {
  for g in $2; do
    for sh in $3; do
      step tf_s${sh}_g${g}_$1 90 env $S=$g $FS --timing --iters 20 --staged --no-check --shape "${SHAPES[$sh]}"
      collect
    done
    step tb_g${g}_$1 90 env $S=$g $BS --timing --iters 20 --no-check
    collect
  done
}
# The decisive A/B first (0 against 2, twice, in alternating order), then 1 and 3.
if has timing; then
  timing_pass r1 "0 2" "1 2 3 4"
  timing_pass r2 "2 0" "1 2 3 4"
  timing_pass r3 "1 3" "1 4"
fi
if has sass; then
  for o in gemm_wgmma gemm_wgmma_bwd; do
    cuobjdump --dump-sass $B/lib/$o.o | awk -v o=$o '/Function :/{f=$3; seen[f]=1} /HGMMA/{h[f]++} /BAR.ARV/{a[f]++} /BAR.SYNC/{s[f]++} /LDL|STL/{l[f]++}
      END{for(k in seen) printf "%s: HGMMA %d BAR.ARV %d BAR.SYNC %d LDL/STL %d  %s\n", o, h[k], a[k], s[k], l[k], substr(k,1,100)}'
  done > "$out/sass.txt" 2>&1
fi
collect
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    step ${tool}_fwd 150 env $S=2 compute-sanitizer --tool $tool --error-exitcode 9 $FS --case stagger_k --staged
    step ${tool}_bwd 150 env $S=2 compute-sanitizer --tool $tool --error-exitcode 9 $BS --case stagger_k
  done
fi
collect
collect
{
  echo "================ summary"
  cat "$out/gpu.txt" 2>/dev/null
  cat "$out/sass.txt" 2>/dev/null
  printf '%s\n' "${summary[@]}" | grep -v '^t[fb]_'
  for f in "$out"/corr_*.log; do [ -f "$f" ] && { echo "-- $(basename $f)"; grep -E "FAIL|correctness|bitwise" "$f" | tail -3 | cut -c1-160; }; done
  for f in "$out"/*check_*.log; do [ -f "$f" ] && echo "-- $(basename $f): $(grep -E 'ERROR SUMMARY' "$f" | tail -1)"; done
  echo "-- forward staged (ms: total | gate/up | down)"
  for f in "$out"/tf_*.log; do
    [ -f "$f" ] || continue
    printf '%-16s %s | %s\n' "$(basename $f .log)" "$(grep -oE 'total +median [0-9.]+' "$f" | grep -oE '[0-9.]+$')" \
      "$(grep -oE 'gate/up [0-9.]+ ms \([0-9.]+ TF\) \| down [0-9.]+ ms \([0-9.]+ TF\)' "$f")"
  done
  echo "-- backward staged shape 1 (ms: total | stages)"
  for f in "$out"/tb_*.log; do
    [ -f "$f" ] || continue
    printf '%-12s %s | %s\n' "$(basename $f .log)" "$(grep -oE 'backward median [0-9.]+' "$f" | grep -oE '[0-9.]+$')" \
      "$(grep -oE 'dgrad-down\+swiglu [0-9.]+ ms.*' "$f" | cut -c1-150)"
  done
} | tee "$final/summary.txt"
collect
