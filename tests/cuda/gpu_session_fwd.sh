#!/usr/bin/env bash
# One device call for the CUDA forward megakernel: standalone build, SASS check,
# correctness (default knobs and a tiny ring), timing of the megakernel, its
# knob variants and the staged path, compute-sanitizer, Python build + GPU pytest.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_fwd.sh [steps...]
#   steps default: build sass corr corr_ring timing staged knobs memcheck racecheck synccheck pytest
#   more steps: corr_staged (the staged kernels' correctness cases),
#   memcheck_staged racecheck_staged synccheck_staged, units4,
#   timing_big staged_big (megakernel / staged timing at $BIG_SHAPE, default
#   Mixtral), cluster (staged with single-CTA GEMM launches instead of the
#   default 2-CTA clusters: correctness, timing at shape 1 and $BIG_SHAPE),
#   ncu (LaunchStats / SOL / memory sections of the staged GEMMs at $BIG_SHAPE,
#   cluster 1 and 2)
#   PYTEST_K: pytest -k filter (default: megakernel or graphs)
set -uo pipefail
# Logs go to $LOGS; $OUT gets them as one file (all_logs.txt): the device
# tool brings back only a few files.
final="${OUT:-/tmp/mok_fwd_out}"
out="${LOGS:-/tmp/mok_fwd_logs}"
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B=/tmp/mok_fwd_build
steps="${*:-build sass corr corr_ring timing staged knobs memcheck racecheck synccheck pytest}"
source "$(dirname "$0")/session_common.sh"
FS=$B/forward_standalone
if has build; then
  step build 240 env OUTDIR=$B BUILD_ONLY=1 bash tests/cuda/build_and_run.sh || { tail -40 "$out/build.log"; }
fi
if has sass; then
  { echo "HGMMA per kernel:";
    for o in megakernel_fwd gemm_wgmma; do cuobjdump --dump-sass $B/$o.o | awk -v o=$o '/Function :/{f=$3} /HGMMA/{c[f]++} /LDL|STL/{l[f]++} END{for(k in c) print o": "c[k]" HGMMA, "l[k]+0" LDL/STL", substr(k,1,90)}'; done;
    grep -h -A3 "megakernel" $B/megakernel_fwd.ptxas.txt | grep -E "registers|spill" ; } > "$out/sass.txt" 2>&1
fi
has corr && step corr 120 $FS --correctness
has corr_ring && step corr_ring 120 $FS --small --ring-rows 128 --minibatch-rows 128 --dispatch-ctas 1
has timing && step timing 90 $FS --timing --iters 30
if has units4; then  # the dispatch copy with four units in flight per warp
  step build_u4 240 env OUTDIR=$B.u4 BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_DISPATCH_UNITS=4 bash tests/cuda/build_and_run.sh
  step timing_u4 90 $B.u4/forward_standalone --timing --iters 30
fi
has staged && step staged 90 $FS --timing --iters 30 --staged
BIG="${BIG_SHAPE:-8192,4096,14336,8,2}"
has timing_big && step timing_big 120 $FS --timing --iters 20 --shape "$BIG"
has staged_big && step staged_big 120 $FS --timing --iters 20 --staged --shape "$BIG"
if has cluster; then
  step corr_cluster1 120 env MOK_CUDA_GEMM_CLUSTER=1 $FS --correctness --staged
  step cluster1 90 env MOK_CUDA_GEMM_CLUSTER=1 $FS --timing --iters 20 --staged
  step cluster1_big 120 env MOK_CUDA_GEMM_CLUSTER=1 $FS --timing --iters 20 --staged --shape "$BIG"
fi
if has ncu; then
  for c in 1 2; do
    step ncu_c$c 150 env MOK_CUDA_GEMM_CLUSTER=$c ncu --clock-control none -k regex:grouped_gemm -c 2 \
      --section LaunchStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats $FS --timing --iters 1 --staged --shape "$BIG"
  done
fi
has corr_staged && step corr_staged 120 $FS --correctness --staged
if has knobs; then
  # KNOBS: variants separated by ';'
  IFS=';' read -ra knobs <<< "${KNOBS:---dispatch-ctas 4;--dispatch-ctas 8;--dispatch-ctas 32;--dispatch-ctas 48;--ring-rows 8192;--minibatch-rows 256;--minibatch-rows 512}"
  for v in "${knobs[@]}"; do
    n="knob_$(echo $v | tr -d ' -')"
    step "$n" 60 $FS --timing --iters 20 $v
  done
fi
has memcheck && step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 $FS --case odd_dims --ring-rows 128 --dispatch-ctas 2
has racecheck && step racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 9 $FS --case base --ring-rows 128
has synccheck && step synccheck 90 compute-sanitizer --tool synccheck --error-exitcode 9 $FS --case base --ring-rows 128
for tool in memcheck racecheck synccheck; do
  has ${tool}_staged && step ${tool}_staged 90 compute-sanitizer --tool $tool --error-exitcode 9 $FS --case odd_dims --staged
done
has pytest && pytest_step 240 -k "${PYTEST_K:-megakernel or graphs}"
echo "================ summary"
cat "$out/gpu.txt" 2>/dev/null
cat "$out/sass.txt" 2>/dev/null
[ -f "$out/corr.log" ] && grep -E "FAIL|correctness" "$out/corr.log" | cut -c1-200
[ -f "$out/corr_ring.log" ] && grep -E "FAIL|correctness" "$out/corr_ring.log" | cut -c1-200
for f in corr_staged corr_cluster1; do [ -f "$out/$f.log" ] && grep -E "FAIL|correctness" "$out/$f.log" | cut -c1-200; done
grep -h "resident clusters" "$out"/*.log 2>/dev/null | head -1
for f in ncu_c1 ncu_c2; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "grouped_gemm|Grid Size|Cluster Size|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy" "$out/$f.log" | cut -c1-120; }; done
for f in timing timing_u4 staged timing_big staged_big cluster1 cluster1_big knob_*; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "total   median|schedule|determinism|error" "$out/$f.log" | cut -c1-200; }; done
for f in memcheck racecheck synccheck memcheck_staged racecheck_staged synccheck_staged; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|error" "$out/$f.log" | head -5; }; done
[ -f "$out/pytest.log" ] && grep -E "passed|failed|Error" "$out/pytest.log" | tail -8
printf '%s\n' "${summary[@]}"
for f in "$out"/*; do echo "=================== $(basename "$f")"; cat "$f"; done > "$final/all_logs.txt" 2>&1
