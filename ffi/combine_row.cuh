// The arithmetic of one combine step, shared by the staged combine kernel
// (combine.cu) and the megakernel's combine (megakernel_fwd.cu) so that both
// give bitwise the same y: a += w * row in fp32 with an explicit FMA (no
// compiler choice between FMA and MUL+ADD), over 8 bf16 values (16 bytes).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace mok::cuda {

__device__ __forceinline__ void combine_acc8(float (&a)[8], const uint4& v, float w) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    a[2 * i] = __fmaf_rn(w, f.x, a[2 * i]);
    a[2 * i + 1] = __fmaf_rn(w, f.y, a[2 * i + 1]);
  }
}

__device__ __forceinline__ uint4 combine_pack8(const float (&a)[8]) {
  uint4 o;
  uint32_t* op = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 b = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
    op[i] = *reinterpret_cast<uint32_t*>(&b);
  }
  return o;
}

}  // namespace mok::cuda
