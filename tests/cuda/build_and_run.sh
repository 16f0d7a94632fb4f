#!/usr/bin/env bash
# Build and run the standalone CUDA forward test (needs nvcc >= 12.3 and, to run,
# a Hopper GPU).  Usage: tests/cuda/build_and_run.sh [args for forward_standalone]
#   BUILD_ONLY=1  only build;  OUTDIR=dir  where the binary goes (default build/cuda_test)
#   EXTRA_NVCC_FLAGS  more nvcc flags (e.g. -DMOK_DISPATCH_UNITS=4 for a variant)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${OUTDIR:-$root/build/cuda_test}"
mkdir -p "$out"
NVCC="${NVCC:-nvcc}"
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -lineinfo ${EXTRA_NVCC_FLAGS:-})
srcs=(schedule dispatch gemm_wgmma gemm_wgmma_pingpong combine megakernel_fwd forward_cuda)
pids=()
for s in "${srcs[@]}"; do
  "$NVCC" "${flags[@]}" -c "$root/ffi/$s.cu" -o "$out/$s.o" >"$out/$s.ptxas.txt" 2>&1 &
  pids+=($!)
done
"$NVCC" "${flags[@]}" -c "$here/forward_standalone.cu" -o "$out/forward_standalone.o" >"$out/test.ptxas.txt" 2>&1 &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ $rc -ne 0 ]; then cat "$out"/*.ptxas.txt; exit 1; fi
"$NVCC" -o "$out/forward_standalone" "$out"/*.o -lpthread
grep -h -A2 "grouped_gemm_kernel" "$out/gemm_wgmma.ptxas.txt" | grep -E "registers|spill" || true
grep -h -E "warning|C7508" "$out"/*.ptxas.txt || true
if [ "${BUILD_ONLY:-0}" = "1" ]; then exit 0; fi
"$out/forward_standalone" "$@"
