#!/usr/bin/env bash
# Build and run the standalone CUDA backward test (needs nvcc >= 12.3 and, to run,
# a Hopper GPU).  Usage: tests/cuda/build_and_run_backward.sh [args for backward_standalone]
#   BUILD_ONLY=1  only build;  OUTDIR=dir  where the binaries go (default build/cuda_test_bwd)
#   EXTRA_NVCC_FLAGS  more nvcc flags (e.g. -DMOK_GEMM_EPILOGUE_PROBE=1, measurement only)
# Also builds forward_standalone from the same objects (the forward shares gemm/ptx code).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${OUTDIR:-$root/build/cuda_test_bwd}"
mkdir -p "$out/lib"
NVCC="${NVCC:-nvcc}"
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -lineinfo ${EXTRA_NVCC_FLAGS:-})
srcs=(schedule dispatch gemm_wgmma gemm_wgmma_pingpong gemm_wgmma_bwd gemm_wgmma_bwd_pingpong combine megakernel_fwd megakernel_bwd forward_cuda backward_cuda)
pids=()
for s in "${srcs[@]}"; do
  "$NVCC" "${flags[@]}" -c "$root/ffi/$s.cu" -o "$out/lib/$s.o" >"$out/$s.ptxas.txt" 2>&1 &
  pids+=($!)
done
for t in backward_standalone forward_standalone; do
  "$NVCC" "${flags[@]}" -c "$here/$t.cu" -o "$out/$t.o" >"$out/$t.ptxas.txt" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ $rc -ne 0 ]; then cat "$out"/*.ptxas.txt; exit 1; fi
"$NVCC" -o "$out/backward_standalone" "$out/backward_standalone.o" "$out"/lib/*.o -lpthread
"$NVCC" -o "$out/forward_standalone" "$out/forward_standalone.o" "$out"/lib/*.o -lpthread
grep -h -A2 "bwd_gemm_kernel" "$out/gemm_wgmma_bwd.ptxas.txt" | grep -E "registers|spill" || true
grep -h -E "warning|C75" "$out"/*.ptxas.txt || true
if [ "${BUILD_ONLY:-0}" = "1" ]; then exit 0; fi
"$out/backward_standalone" "$@"
