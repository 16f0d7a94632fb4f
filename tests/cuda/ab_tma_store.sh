#!/usr/bin/env bash
# The TMA-store epilogues, the token-major dispatch and the inference forward
# without residuals (the defaults since 2026-12-05, benchmarks/RESULTS.md
# "Twelfth session") against the kernels they replaced, in the same binaries:
# the TMA-store epilogues (built with -DMOK_GEMM_TMA_STORE=1, off at run time
# with MOK_CUDA_GEMM_TMA_STORE=0) and the token-major dispatch
# gather (MOK_CUDA_DISPATCH=tokens, any build). Steps (STEPS, default all, too
# many for one 600 s device call: run "fwd memcheck", then "pytest bwd", then "bench"):
#   fwd      staged forward: SASS counts, correctness (with the no-residuals
#            run; also with the token-major dispatch), A/B at the 4 shapes,
#            the no-residuals forward and the token-major dispatch timed
#   memcheck compute-sanitizer memcheck of the staged forward, small case
#   pytest   Python build with the TMA store (MOK_JAX_GEMM_TMA_STORE=ON, on by
#            default in that build) + GPU pytest subset, through JAX
#   bench    benchmarks.run, shapes 1-4, cuda + torch, fwd and fwd+bwd, in the
#            same build with the TMA store on, then off (MOK_CUDA_GEMM_TMA_STORE=0),
#            both with every other pending variant on (token-major dispatch,
#            inference forward without residuals)
#   bwd      backward: epilogue probe 0/1, then the TMA-store epilogues
#            (d_x dgrad, weight gradients, SwiGLU-backward dgrad): correctness
#            of all three and of each alone (MOK_CUDA_BWD_TMA_STORE=1/2/4),
#            memcheck of a small case, A/B at shape 1 (all three, then each)
# Usage (GPU host, repo root): STEPS="fwd memcheck" bash tests/cuda/ab_tma_store.sh
set -uo pipefail
L="${OUT:-/tmp/ab_out}"; mkdir -p "$L"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
STEPS=" ${STEPS:-fwd memcheck pytest bwd bench} "
has() { [[ "$STEPS" == *" $1 "* ]]; }
B=/tmp/ab_build
if has pytest; then
  (MOK_JAX_GEMM_TMA_STORE=ON python3 -m pip install --no-build-isolation --no-deps -e . > "$L/pip.log" 2>&1
   echo "pip rc $?" >> "$L/pip.log") &
  pip_pid=$!
fi
if has fwd || has memcheck; then
  OUTDIR=$B BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_TMA_STORE=1 bash tests/cuda/build_and_run.sh > "$L/build.log" 2>&1 ||
    { echo BUILD FAILED; tail -30 "$L/build.log"; }
fi
if has fwd; then
  cuobjdump --dump-sass $B/gemm_wgmma.o | grep -cE "HGMMA" | sed 's/^/HGMMA in gemm_wgmma: /'
  cuobjdump --dump-sass $B/gemm_wgmma.o | grep -cE "UTMASTG" | sed 's/^/UTMASTG in gemm_wgmma: /'
  timeout 150 $B/forward_standalone --correctness --staged > "$L/corr.log" 2>&1; echo "corr rc $?"
  grep -cE "PASS" "$L/corr.log" | sed 's/^/PASS lines: /'; grep -E "FAIL|RESULT" "$L/corr.log" | head -5
  MOK_CUDA_DISPATCH=tokens timeout 150 $B/forward_standalone --correctness --staged > "$L/corr_tokens.log" 2>&1
  echo "corr (token-major dispatch) rc $?"; grep -E "FAIL|RESULT" "$L/corr_tokens.log" | head -5
  for s in 32768,2048,768,128,8 32768,4096,1024,128,8 4096,7168,2048,32,8 8192,4096,14336,8,2; do
    for v in 1 0 1 0; do
      echo "== tma_store=$v shape $s"
      MOK_CUDA_GEMM_TMA_STORE=$v timeout 60 $B/forward_standalone --timing --iters 20 --staged --no-check --shape $s > "$L/t.log" 2>&1
      grep -E "total   median|gate/up|determinism|error|FAIL" "$L/t.log" | cut -c1-160
    done
    for d in tokens rows; do  # the dispatch gather, token-major or row-major
      echo "== dispatch=$d shape $s"
      MOK_CUDA_DISPATCH=$d MOK_CUDA_GEMM_TMA_STORE=0 timeout 60 $B/forward_standalone --timing --iters 20 --staged --no-check --shape $s > "$L/t.log" 2>&1
      grep -E "total   median|dispatch|determinism|error|FAIL" "$L/t.log" | cut -c1-160
    done
    for v in 1 0; do  # the inference forward: no gate/up pre-activations stored
      echo "== no-residuals tma_store=$v shape $s"
      MOK_CUDA_GEMM_TMA_STORE=$v timeout 60 $B/forward_standalone --timing --iters 20 --staged --no-check --no-residuals --shape $s > "$L/t.log" 2>&1
      grep -E "total   median|gate/up|determinism|error|FAIL" "$L/t.log" | cut -c1-160
    done
  done
fi
if has memcheck; then
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $B/forward_standalone --case odd_dims --staged > "$L/memcheck.log" 2>&1
  echo "memcheck rc $?"; grep -E "ERROR SUMMARY" "$L/memcheck.log"
fi
if has pytest; then
  wait $pip_pid; tail -1 "$L/pip.log"
  python3 -c "import mok_jax.info as i; print('build options', i.cuda_build_options())"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    -k "forward_small or forward_edge or layer_gradients or backward_edge or megakernel_equals or graphs or inference" > "$L/pytest.log" 2>&1
  tail -3 "$L/pytest.log"
  MOK_CUDA_DISPATCH=tokens MOK_JAX_CUDA_DROP_RESIDUALS=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu.py -k "forward_small or forward_edge or backward_edge" > "$L/pytest_tokens.log" 2>&1
  echo "token-major dispatch + inference forward without residuals:"; tail -2 "$L/pytest_tokens.log"
fi
if has bwd; then
  for v in 0 1; do  # the backward's epilogue cost at shape 1: its stores dropped (probe 1) or not
    OUTDIR=/tmp/ab_bwd$v BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_EPILOGUE_PROBE=$v bash tests/cuda/build_and_run_backward.sh > "$L/build_bwd$v.log" 2>&1 &
  done
  OUTDIR=/tmp/ab_bwd_tma_a1 BUILD_ONLY=1 EXTRA_NVCC_FLAGS="-DMOK_GEMM_TMA_STORE=1 -DMOK_SWIGLU_BWD_AHEAD=1" \
    bash tests/cuda/build_and_run_backward.sh > "$L/build_bwd_tma_a1.log" 2>&1 &
  OUTDIR=/tmp/ab_bwd_tma BUILD_ONLY=1 EXTRA_NVCC_FLAGS=-DMOK_GEMM_TMA_STORE=1 bash tests/cuda/build_and_run_backward.sh > "$L/build_bwd_tma.log" 2>&1 ||
    echo "BWD TMA BUILD FAILED"
  wait
  for v in 0 1; do
    echo "== backward probe $v"
    timeout 90 /tmp/ab_bwd$v/backward_standalone --timing --iters 20 --no-check > "$L/bwd$v.log" 2>&1
    grep -E "backward median|prep\+gather" "$L/bwd$v.log" | cut -c1-200
  done
  for m in 7 1 2 4; do
    MOK_CUDA_BWD_TMA_STORE=$m timeout 150 /tmp/ab_bwd_tma/backward_standalone --correctness > "$L/bwd_corr$m.log" 2>&1
    echo "bwd corr (epilogues $m) rc $?"; grep -E "FAIL|RESULT" "$L/bwd_corr$m.log" | head -5
  done
  MOK_CUDA_DISPATCH=tokens timeout 150 /tmp/ab_bwd0/backward_standalone --correctness > "$L/bwd_corr_tokens.log" 2>&1
  echo "bwd corr (token-major dispatch) rc $?"; grep -E "FAIL|RESULT" "$L/bwd_corr_tokens.log" | head -5
  for d in tokens rows; do
    echo "== backward dispatch=$d"
    MOK_CUDA_DISPATCH=$d timeout 90 /tmp/ab_bwd0/backward_standalone --timing --iters 20 --no-check > "$L/bwd_t.log" 2>&1
    grep -E "backward median|prep\+gather" "$L/bwd_t.log" | cut -c1-200
  done
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/ab_bwd_tma/backward_standalone --case odd_dims > "$L/bwd_memcheck.log" 2>&1
  echo "bwd memcheck rc $?"; grep -E "ERROR SUMMARY" "$L/bwd_memcheck.log"
  for v in 7 0 7 0 1 2 4; do
    echo "== backward tma epilogues=$v"
    MOK_CUDA_BWD_TMA_STORE=$v timeout 90 /tmp/ab_bwd_tma/backward_standalone --timing --iters 20 --no-check > "$L/bwd_t.log" 2>&1
    grep -E "backward median|prep\+gather" "$L/bwd_t.log" | cut -c1-200
  done
  echo "== backward tma, SwiGLU loads 1 chunk ahead (default 2)"
  timeout 90 /tmp/ab_bwd_tma_a1/backward_standalone --timing --iters 20 --no-check > "$L/bwd_t.log" 2>&1
  grep -E "backward median|prep\+gather" "$L/bwd_t.log" | cut -c1-200
fi
if has bench; then  # needs the "pytest" step's build (MOK_JAX_GEMM_TMA_STORE=ON)
  # all three on (the defaults); the TMA store alone off; the kernels they replaced
  for run in "all MOK_CUDA_GEMM_TMA_STORE=1 MOK_CUDA_DISPATCH=tokens MOK_JAX_CUDA_DROP_RESIDUALS=1" \
             "notma MOK_CUDA_GEMM_TMA_STORE=0 MOK_CUDA_DISPATCH=tokens MOK_JAX_CUDA_DROP_RESIDUALS=1" \
             "base MOK_CUDA_GEMM_TMA_STORE=0 MOK_CUDA_DISPATCH=rows MOK_JAX_CUDA_DROP_RESIDUALS=0"; do
    set -- $run; tag=$1; shift
    env "$@" timeout 180 python3 -m benchmarks.run --shapes 1,2,3,4 --impls cuda,torch --passes fwd,fwd+bwd \
      --sweep '' --no-plots --iters 20 --out "$L" --tag "bench_$tag" > "$L/bench_$tag.log" 2>&1
    echo "== bench $tag ($*) rc $?"; grep -E "^\| (qwen|sonic|dsv3|mixtral)" "$L/bench_$tag.log" | cut -d'|' -f2,5-8
  done
fi
