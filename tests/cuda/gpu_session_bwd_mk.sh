#!/usr/bin/env bash
# One device call for the persistent backward megakernel (megakernel_bwd.cu): four builds,
#   /tmp/mk1: the default (inlined consume task, task read from its shared slot)
#   /tmp/mk0: MOK_BWD_MEGAKERNEL_INLINE=0 (__noinline__ consume task)
#   /tmp/mk2: MOK_BWD_MEGAKERNEL_PHASED=1 (the staged kernels' task order)
#   /tmp/mk3: MOK_BWD_MEGAKERNEL_TASK_IN_SMEM=0 (the task copied to registers, 152 B of spills)
# (variants measured and removed from the source, e.g. the producer's decode-ahead and wait
# cache of 2026-12-06, are recorded in benchmarks/RESULTS.md),
# then SASS check (HGMMA, wgmma fences, local memory and generic loads per function), bitwise
# correctness against the staged backward, compute-sanitizer memcheck, timing staged vs
# megakernel (alternating), and (steps ncu, ncu_src, not in the default set) warp-stall and
# pipe counters, and per-instruction stall samples, of the megakernel and of the staged GEMM
# kernels at the harness's timing shape.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_bwd_mk.sh [steps...]
#   steps default: build sass corr memcheck timing (more: ncu, ncu_src)
set -uo pipefail
out="${OUT:-/tmp/mok_bwd_mk_out}"
mkdir -p "$out"
steps="${*:-build sass corr memcheck timing}"
source "$(dirname "$0")/session_common.sh"
B0=/tmp/mk0; B1=/tmp/mk1; B2=/tmp/mk2; B3=/tmp/mk3
if has build; then
  build() {  # build DIR LOG FLAGS
    (OUTDIR=$1 BUILD_ONLY=1 EXTRA_NVCC_FLAGS="$3" bash tests/cuda/build_and_run_backward.sh > "$out/$2.log" 2>&1; echo $? > /tmp/$2.rc) &
  }
  build $B0 build0 -DMOK_BWD_MEGAKERNEL_INLINE=0
  build $B1 build1 ""
  build $B2 build2 -DMOK_BWD_MEGAKERNEL_PHASED=1
  build $B3 build3 -DMOK_BWD_MEGAKERNEL_TASK_IN_SMEM=0
  wait
  summary+=("build inline0 rc=$(cat /tmp/build0.rc) default rc=$(cat /tmp/build1.rc) phased rc=$(cat /tmp/build2.rc) task_in_regs rc=$(cat /tmp/build3.rc)")
fi
sass_counts() {  # per function: HGMMA, WARPGROUP.DEPBAR, WARPGROUP.ARRIVE, LDL+STL, generic LD
  cuobjdump --dump-sass "$1" | awk '/Function :/{f=$3} /HGMMA/{h[f]++} /WARPGROUP.DEPBAR/{d[f]++} /WARPGROUP.ARRIVE/{a[f]++} /LDL|STL/{l[f]++} / LD\./{g[f]++} /Function :/{seen[f]=1}
    END{for(k in seen) printf "  HGMMA %4d DEPBAR %4d ARRIVE %4d LDL/STL %4d LD %4d  %s\n", h[k], d[k], a[k], l[k], g[k], k}'
}
if has sass; then
  { for b in $B0 $B1 $B2 $B3; do
      echo "== $b megakernel_bwd.o"; sass_counts $b/lib/megakernel_bwd.o
      echo "== $b gemm_wgmma_bwd.o"; sass_counts $b/lib/gemm_wgmma_bwd.o
      grep -h -E "registers|spill|C75" $b/megakernel_bwd.ptxas.txt | head -20
    done; } > "$out/sass.txt" 2>&1
fi
if has corr; then
  step corr0 150 $B0/backward_standalone --correctness --megakernel
  step corr1 150 $B1/backward_standalone --correctness --megakernel
  step corr2 150 $B2/backward_standalone --correctness --megakernel
  step corr3 150 $B3/backward_standalone --correctness --megakernel
fi
has memcheck && step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B1/backward_standalone --case odd_dims --megakernel
if has timing; then
  step t_mk1_check 90 $B1/backward_standalone --timing --iters 20 --megakernel
  for r in 1 2; do
    step t_staged$r 60 $B0/backward_standalone --timing --iters 20 --no-check
    # the staged kernels with the megakernel's register epilogues (TMA stores off)
    step t_staged_reg$r 60 env MOK_CUDA_BWD_TMA_STORE=0 $B0/backward_standalone --timing --iters 20 --no-check
    step t_mk0_$r 60 $B0/backward_standalone --timing --iters 20 --no-check --megakernel
    step t_mk1_$r 60 $B1/backward_standalone --timing --iters 20 --no-check --megakernel
    step t_mk2_$r 60 $B2/backward_standalone --timing --iters 20 --no-check --megakernel
    step t_mk3_$r 60 $B3/backward_standalone --timing --iters 20 --no-check --megakernel
  done
fi
if has ncu; then
  # raw page: every metric of the sections, grepped below (stall reasons per issued
  # instruction, tensor-pipe activity, L2 hit rate, DRAM bytes, duration)
  nsec="--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats"
  step ncu_mk 200 ncu --clock-control none -k regex:moe_backward_megakernel --launch-skip 1 -c 1 $nsec --page raw \
    $B1/backward_standalone --timing --iters 2 --no-check --megakernel
  step ncu_staged 200 ncu --clock-control none -k regex:bwd_gemm_kernel --launch-skip 3 -c 3 $nsec --page raw \
    $B1/backward_standalone --timing --iters 2 --no-check
fi
if has ncu_src; then
  # per-source-line and per-SASS-instruction warp-stall samples (where the megakernel's
  # extra long-scoreboard, no-instruction and branch stalls sit); the report stays in /tmp
  ncu_src() {  # ncu_src NAME "KERNEL SELECTION" [harness args...]
    local k=$1 sel=$2; shift 2
    step ncu_src_$k 240 ncu --clock-control none $sel --section SourceCounters --section WarpStateStats \
      --import-source yes -f -o /tmp/src_$k $B1/backward_standalone --timing --iters 2 --no-check "$@"
    ncu -i /tmp/src_$k.ncu-rep --page source --csv --print-source sass > /tmp/src_${k}_sass.csv 2>&1
    python3 tests/cuda/ncu_stall_table.py /tmp/src_${k}_sass.csv 30 > "$out/stall_$k.txt" 2>&1
  }
  ncu_src mk "-k regex:moe_backward_megakernel --launch-skip 1 -c 1" --megakernel
  ncu_src staged "-k regex:bwd_gemm_kernel --launch-skip 3 -c 3"
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in corr0 corr1 corr2 corr3; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "FAIL|DIFFERS|correctness:" "$out/$f.log" | cut -c1-200 | tail -5; }; done
[ -f "$out/memcheck.log" ] && grep -E "ERROR SUMMARY" "$out/memcheck.log"
for f in "$out"/t_*.log; do [ -f "$f" ] && { echo "-- $(basename $f)"; grep -E "median|megakernel|staged|TFLOP|check" "$f" | cut -c1-230 | tail -4; }; done
for f in ncu_mk ncu_staged; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "bwd_gemm_kernel|moe_backward_megakernel|gpu__time_duration.sum|issue_stalled_[a-z_]+_per_warp_active.pct |warp_latency_issue_stalled|smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio|gmma|lts__t_sector_hit_rate.pct |dram__bytes.sum |smsp__inst_executed.sum |sm__throughput.avg.pct" "$out/$f.log" | awk '{$1=$1}1' | cut -c1-140; }; done
printf '%s\n' "${summary[@]}"
