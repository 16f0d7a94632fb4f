#!/usr/bin/env bash
# One device call for the persistent backward megakernel (megakernel_bwd.cu): three builds
# (MOK_BWD_MEGAKERNEL_INLINE=0: __noinline__ consume task, 1: force-inlined (default);
# /tmp/mk2: inlined with MOK_BWD_MEGAKERNEL_PHASED=1, the staged kernels' task order;
# /tmp/mk3: inlined with MOK_BWD_MEGAKERNEL_TASK_IN_SMEM=0, the task copied to registers, 152 B
# of spills; the default since 2026-12-06 reads it from shared memory), SASS check
# (HGMMA, wgmma fences, local memory per function), bitwise correctness against the staged
# backward, compute-sanitizer memcheck, timing staged vs megakernel (alternating), and (step
# ncu, not in the default set) warp-stall and pipe counters of the megakernel and of the
# staged GEMM kernels at the harness's timing shape.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_bwd_mk.sh [steps...]
#   steps default: build sass corr memcheck timing
set -uo pipefail
out="${OUT:-/tmp/mok_bwd_mk_out}"
mkdir -p "$out"
steps="${*:-build sass corr memcheck timing}"
source "$(dirname "$0")/session_common.sh"
B0=/tmp/mk0; B1=/tmp/mk1; B2=/tmp/mk2; B3=/tmp/mk3
if has build; then
  (OUTDIR=$B0 BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_BWD_MEGAKERNEL_INLINE=0 bash tests/cuda/build_and_run_backward.sh > "$out/build0.log" 2>&1; echo $? > /tmp/b0.rc) &
  (OUTDIR=$B1 BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_BWD_MEGAKERNEL_INLINE=1 bash tests/cuda/build_and_run_backward.sh > "$out/build1.log" 2>&1; echo $? > /tmp/b1.rc) &
  (OUTDIR=$B2 BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_BWD_MEGAKERNEL_PHASED=1 bash tests/cuda/build_and_run_backward.sh > "$out/build2.log" 2>&1; echo $? > /tmp/b2.rc) &
  (OUTDIR=$B3 BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_BWD_MEGAKERNEL_TASK_IN_SMEM=0 bash tests/cuda/build_and_run_backward.sh > "$out/build3.log" 2>&1; echo $? > /tmp/b3.rc) &
  wait
  summary+=("build inline0 rc=$(cat /tmp/b0.rc) inline1 rc=$(cat /tmp/b1.rc) phased rc=$(cat /tmp/b2.rc) task_in_regs rc=$(cat /tmp/b3.rc)")
fi
sass_counts() {  # per function: HGMMA, WARPGROUP.DEPBAR, WARPGROUP.ARRIVE, LDL+STL
  cuobjdump --dump-sass "$1" | awk '/Function :/{f=$3} /HGMMA/{h[f]++} /WARPGROUP.DEPBAR/{d[f]++} /WARPGROUP.ARRIVE/{a[f]++} /LDL|STL/{l[f]++} /Function :/{seen[f]=1}
    END{for(k in seen) printf "  HGMMA %4d DEPBAR %4d ARRIVE %4d LDL/STL %4d  %s\n", h[k], d[k], a[k], l[k], k}'
}
if has sass; then
  { for b in $B0 $B1 $B3; do
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
has memcheck && step memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B0/backward_standalone --case odd_dims --megakernel
if has timing; then
  step t_mk0_check 90 $B0/backward_standalone --timing --iters 20 --megakernel
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
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in corr0 corr1 corr2 corr3; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "FAIL|DIFFERS|correctness:" "$out/$f.log" | cut -c1-200 | tail -5; }; done
[ -f "$out/memcheck.log" ] && grep -E "ERROR SUMMARY" "$out/memcheck.log"
for f in "$out"/t_*.log; do [ -f "$f" ] && { echo "-- $(basename $f)"; grep -E "median|megakernel|staged|TFLOP|check" "$f" | cut -c1-230 | tail -4; }; done
for f in ncu_mk ncu_staged; do [ -f "$out/$f.log" ] && { echo "-- $f"; grep -E "bwd_gemm_kernel|moe_backward_megakernel|gpu__time_duration.sum|issue_stalled_[a-z_]+_per_warp_active.pct |warp_latency_issue_stalled|smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active.ratio|gmma|lts__t_sector_hit_rate.pct |dram__bytes.sum |smsp__inst_executed.sum |sm__throughput.avg.pct" "$out/$f.log" | awk '{$1=$1}1' | cut -c1-140; }; done
printf '%s\n' "${summary[@]}"
