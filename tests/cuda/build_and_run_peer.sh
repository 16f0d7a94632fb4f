#!/usr/bin/env bash
# Build and run the virtual-rank test of the peer-dispatch protocol
# (tests/cuda/peer_standalone.cu; needs nvcc >= 12.3 and, to run, a Hopper GPU).
# Usage: tests/cuda/build_and_run_peer.sh [--lost-peer | --timing [iters]]
#   BUILD_ONLY=1  only build;  OUTDIR=dir  where the binary goes (default build/cuda_test_peer)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${OUTDIR:-$root/build/cuda_test_peer}"
mkdir -p "$out/lib"
NVCC="${NVCC:-nvcc}"
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -lineinfo)
srcs=(schedule dispatch gemm_wgmma gemm_wgmma_pingpong gemm_wgmma_bwd gemm_wgmma_bwd_pingpong combine megakernel_fwd megakernel_bwd forward_cuda backward_cuda peer_dispatch peer_forward peer_backward)
pids=()
for s in "${srcs[@]}"; do
  "$NVCC" "${flags[@]}" -c "$root/ffi/$s.cu" -o "$out/lib/$s.o" >"$out/$s.log" 2>&1 &
  pids+=($!)
done
"$NVCC" "${flags[@]}" -c "$here/peer_standalone.cu" -o "$out/peer_standalone.o" >"$out/test.log" 2>&1 &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ $rc -ne 0 ]; then cat "$out"/*.log; exit 1; fi
"$NVCC" -o "$out/peer_standalone" "$out/peer_standalone.o" "$out"/lib/*.o -lpthread
if [ "${BUILD_ONLY:-0}" = "1" ]; then exit 0; fi
"$out/peer_standalone" "$@"
