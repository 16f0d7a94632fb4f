// One warp copies one token row (vec 16-byte vectors, lane-strided) into its
// dispatch row, or zeros it (src == nullptr: a padding row). Shared by the
// row-major dispatch kernel (dispatch.cu) and the dispatch fused into the
// gate/up GEMM (dispatch_fused.cuh), so both write the same bytes the same
// way. Pointer walks with 4 loads in flight per lane and no unrolled loops:
// it fits the fused copy's 40-register producer warps without spills
// (unrolled loops spilled there).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mok::cuda {

__device__ __forceinline__ void copy_row_warp(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t vec,
                                              int lane) {
  constexpr int kInFlight = 4;
  dst += lane;
  if (src == nullptr) {
#pragma unroll 1
    for (int64_t c = lane; c < vec; c += 32, dst += 32) *dst = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* const end = src + vec;
  src += lane;
#pragma unroll 1
  for (; src + 32 * (kInFlight - 1) < end; src += 32 * kInFlight, dst += 32 * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) v[i] = __ldg(src + 32 * i);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) dst[32 * i] = v[i];
  }
#pragma unroll 1
  for (; src < end; src += 32, dst += 32) *dst = __ldg(src);
}

}  // namespace mok::cuda
