#!/usr/bin/env bash
# One device call for the load-ring depth / TMA-store staging trade of the
# staged GEMMs (same shared memory: 4 stages x 2 store buffers per consumer
# warp, the shipped build, against 3 x 5 and, to tell the two effects apart,
# 3 x 2; with 5 buffers the backward's SwiGLU TMA ring also grows from 4 to 8
# regions): builds of both harnesses per variant, local-memory check, forward and
# backward correctness of the variants (the backward bitwise against the
# megakernel of the same build), alternated timings (forward at the four
# benchmark shapes, backward at shape 1), and optionally the ncu warp-stall
# table of the shipped build's forward GEMMs at shape 1.
# Usage (GPU host, repo root): bash tests/cuda/gpu_session_stages.sh [steps...]
#   steps default: build sass corr timing btiming (more: ncu_src; waitprobe: the shipped
#   tile built with -DMOK_GEMM_WAIT_PROBE=1, the consumers' waits for stage data per place
#   of the k block in its tile, 2-CTA clusters and single CTAs, at $SHAPES)
#   VARIANTS: "STAGES:BUFS ..." (default "4:2 3:5 3:2"); SHAPES: forward timing shapes
set -uo pipefail
final="${OUT:-/tmp/mok_stages_out}"
out="${LOGS:-/tmp/mok_stages_logs}"
mkdir -p "$out" "$final"
export PYTHONUNBUFFERED=1
steps="${*:-build sass corr timing btiming}"
source "$(dirname "$0")/session_common.sh"
VARIANTS="${VARIANTS:-4:2 3:5 3:2}"
bdir() { echo "/tmp/mok_stages_${1/:/x}"; }
collect() {  # every log into one file after each step: the device tool returns few files
  for f in "$out"/*; do echo "=================== $(basename "$f")"; cat "$f"; done > "$final/all_logs.txt" 2>&1
}
if has build; then
  pids=()
  for v in $VARIANTS; do
    ( step_name="build_${v/:/x}"
      env OUTDIR="$(bdir "$v")" BUILD_ONLY=1 EXTRA_NVCC_FLAGS="-DMOK_GEMM_STAGES=${v%:*} -DMOK_GEMM_STG_BUFS=${v#*:}" \
        bash tests/cuda/build_and_run_backward.sh > "$out/$step_name.log" 2>&1; echo "rc=$?" >> "$out/$step_name.log" ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for v in $VARIANTS; do summary+=("build_${v/:/x} $(tail -1 "$out/build_${v/:/x}.log")"); done
  collect
fi
if has sass; then
  for v in $VARIANTS; do
    for o in gemm_wgmma gemm_wgmma_bwd; do
      cuobjdump --dump-sass "$(bdir "$v")/lib/$o.o" | awk -v t="$v $o" '/Function :/{f=$3} /HGMMA/{c[f]++} /LDL|STL/{l[f]++}
        END{for(k in c) print t": "c[k]" HGMMA, "l[k]+0" LDL/STL  "substr(k,1,80)}'
    done
  done > "$out/sass.txt" 2>&1
  collect
fi
if has corr; then
  for v in $VARIANTS; do
    [ "$v" = "4:2" ] && continue  # the shipped build: validated on every run of the suites
    b="$(bdir "$v")"
    step "corr_${v/:/x}" 150 "$b/forward_standalone" --correctness --staged
    step "bcorr_${v/:/x}" 200 "$b/backward_standalone" --correctness --megakernel
  done
  collect
fi
SHAPES="${SHAPES:-32768,2048,768,128,8 32768,4096,1024,128,8 4096,7168,2048,32,8 8192,4096,14336,8,2}"
order() { echo "$VARIANTS $(echo $VARIANTS | tr ' ' '\n' | tac | tr '\n' ' ')"; }  # A B C C B A
if has timing; then
  i=0
  for sh in $SHAPES; do
    i=$((i + 1)); n=0
    for v in $(order); do
      n=$((n + 1))
      step "t_s${i}_${n}_${v/:/x}" 90 "$(bdir "$v")/forward_standalone" --timing --iters 20 --staged --no-check --shape "$sh"
    done
    collect
  done
fi
if has btiming; then
  n=0
  for v in $(order); do
    n=$((n + 1))
    step "bt_${n}_${v/:/x}" 90 "$(bdir "$v")/backward_standalone" --timing --iters 20 --no-check
  done
  collect
fi
if has ncu_src; then
  b="$(bdir 4:2)"
  # launch-skip 10: past the 5 warm-up forwards' 2 GEMMs each; -c 2: gate/up, then down
  step ncu_src 300 ncu --clock-control none -k regex:grouped_gemm --launch-skip 10 -c 2 --section SourceCounters \
    --section WarpStateStats --section SpeedOfLight --import-source yes -f -o /tmp/src_fwd \
    "$b/forward_standalone" --timing --iters 1 --staged --no-check
  ncu -i /tmp/src_fwd.ncu-rep --page source --csv --print-source sass > /tmp/src_fwd_sass.csv 2>&1
  python3 tests/cuda/ncu_stall_table.py /tmp/src_fwd_sass.csv 30 > "$out/stall_fwd.txt" 2>&1
  collect
fi
if has waitprobe; then  # the shipped tile with the wait probe compiled in (measurement build)
  b=/tmp/mok_stages_probe
  step build_probe 240 env OUTDIR=$b BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_WAIT_PROBE=1 bash tests/cuda/build_and_run.sh
  i=0
  for sh in $SHAPES; do
    i=$((i + 1))
    step "probe_s$i" 90 $b/forward_standalone --timing --iters 20 --staged --no-check --shape "$sh"
    step "probe_s${i}_c1" 90 env MOK_CUDA_GEMM_CLUSTER=1 $b/forward_standalone --timing --iters 20 --staged --no-check --shape "$sh"
  done
  collect
fi
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in "$out"/corr_*.log "$out"/bcorr_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "FAIL|DIFFERS|correctness:" "$f" | cut -c1-200 | tail -4; }; done
for f in "$out"/t_s*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "total   median" "$f" | sed -E 's/\(min.*//' | tr -s ' ') | $(grep -E "gate/up" "$f" | sed -E 's/.*gate\/up/gate\/up/; s/\| combine.*//' | tr -s ' ')"; done
for f in "$out"/bt_*.log; do [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -E "backward median" "$f" | sed -E 's/\(min.*//' | tr -s ' ') | $(grep -E "prep" "$f" | tr -s ' ' | cut -c1-150)"; done
[ -f "$out/stall_fwd.txt" ] && head -60 "$out/stall_fwd.txt"
for f in "$out"/probe_s*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log): $(grep -E "total   median" "$f" | sed -E 's/\(min.*//' | tr -s ' ')"; grep "wait probe" "$f"; }; done
printf '%s\n' "${summary[@]}"
collect
