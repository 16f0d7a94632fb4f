#!/usr/bin/env bash
# One device call: the staged forward's TMA-store epilogue against the
# register-to-global one (MOK_CUDA_GEMM_TMA_STORE=0) in the same binary:
# correctness of the staged cases, A/B timing at the four benchmark shapes,
# memcheck on a small case, then the Python build (default: no TMA store),
# a GPU pytest subset, the backward probe and the backward TMA-store A/B
# (its plain dgrad epilogue).
# The harnesses are built with -DMOK_GEMM_TMA_STORE=1.
# Usage (GPU host, repo root): bash tests/cuda/ab_tma_store.sh
set -uo pipefail
L="${OUT:-/tmp/ab_out}"; mkdir -p "$L"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B=/tmp/ab_build
(python3 -m pip install --no-build-isolation --no-deps -e . > "$L/pip.log" 2>&1; echo "pip rc $?" >> "$L/pip.log") &
pip_pid=$!
OUTDIR=$B BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_TMA_STORE=1 bash tests/cuda/build_and_run.sh > "$L/build.log" 2>&1 || { echo BUILD FAILED; tail -30 "$L/build.log"; }
cuobjdump --dump-sass $B/gemm_wgmma.o | grep -cE "HGMMA" | sed 's/^/HGMMA in gemm_wgmma: /'
cuobjdump --dump-sass $B/gemm_wgmma.o | grep -cE "UTMASTG" | sed 's/^/UTMASTG in gemm_wgmma: /'
timeout 150 $B/forward_standalone --correctness --staged > "$L/corr.log" 2>&1; echo "corr rc $?"
grep -cE "PASS" "$L/corr.log" | sed 's/^/PASS lines: /'; grep -E "FAIL" "$L/corr.log" | head -5
for s in 32768,2048,768,128,8 32768,4096,1024,128,8 4096,7168,2048,32,8 8192,4096,14336,8,2; do
  for v in 1 0 1 0; do
    echo "== tma_store=$v shape $s"
    MOK_CUDA_GEMM_TMA_STORE=$v timeout 60 $B/forward_standalone --timing --iters 20 --staged --shape $s > "$L/t.log" 2>&1
    grep -E "total   median|gate/up|determinism|error|FAIL" "$L/t.log" | cut -c1-160
  done
done
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/forward_standalone --case odd_dims --staged > "$L/memcheck.log" 2>&1
echo "memcheck rc $?"; grep -E "ERROR SUMMARY" "$L/memcheck.log"
wait $pip_pid; tail -1 "$L/pip.log"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py -k "forward_small or forward_edge or layer_gradients or backward_edge or megakernel_equals or graphs" > "$L/pytest.log" 2>&1
tail -3 "$L/pytest.log"
# The backward's epilogue cost (shape 1): its stores dropped (probe 1) or not.
for v in 0 1; do
  OUTDIR=/tmp/ab_bwd$v BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_EPILOGUE_PROBE=$v bash tests/cuda/build_and_run_backward.sh > "$L/build_bwd$v.log" 2>&1
  echo "== backward probe $v"
  timeout 90 /tmp/ab_bwd$v/backward_standalone --timing --iters 20 > "$L/bwd$v.log" 2>&1
  grep -E "backward median|prep\+gather" "$L/bwd$v.log" | cut -c1-200
done
# The backward with the TMA-store dgrad (kSum2) epilogue: correctness, then A/B.
OUTDIR=/tmp/ab_bwd_tma BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_TMA_STORE=1 bash tests/cuda/build_and_run_backward.sh > "$L/build_bwd_tma.log" 2>&1 || echo "BWD TMA BUILD FAILED"
timeout 150 /tmp/ab_bwd_tma/backward_standalone --correctness > "$L/bwd_corr.log" 2>&1; echo "bwd corr rc $?"
grep -E "FAIL|RESULT" "$L/bwd_corr.log" | head -5
for v in 1 0 1 0; do
  echo "== backward tma_store=$v"
  MOK_CUDA_GEMM_TMA_STORE=$v timeout 90 /tmp/ab_bwd_tma/backward_standalone --timing --iters 20 > "$L/bwd_t.log" 2>&1
  grep -E "backward median|prep\+gather" "$L/bwd_t.log" | cut -c1-200
done
