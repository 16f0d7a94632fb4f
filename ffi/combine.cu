// Combine on the GPU: y[t] = bf16( sum_{k=0..K-1, in order} w[t,k] * out[pair_row[t*K+k]] + s[t] )
// in fp32; y[t] = 0 for masked tokens. Pairs with pair_row == -1 (bad expert id)
// contribute nothing. Fixed order, no atomics: bitwise deterministic.
// One block per token (grid-stride), 8 bf16 (16 bytes) per thread per step.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "combine_row.cuh"
#include "forward_cuda.h"

namespace mok::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxK = 64;

__global__ void __launch_bounds__(kThreads) combine_tokens(int64_t T, int64_t vec_per_row, int K,
                                                           const uint8_t* __restrict__ mask,
                                                           const int32_t* __restrict__ pair_row,
                                                           const float* __restrict__ weights,
                                                           const uint4* __restrict__ out,
                                                           const uint4* __restrict__ shared_out,
                                                           uint4* __restrict__ y) {
  __shared__ int32_t rows[kMaxK];
  __shared__ float ws[kMaxK];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < K) {
      rows[threadIdx.x] = pair_row[t * K + threadIdx.x];
      ws[threadIdx.x] = weights[t * K + threadIdx.x];
    }
    __syncthreads();
    uint4* yrow = y + t * vec_per_row;
    if (mask[t] == 0) {
      for (int64_t c = threadIdx.x; c < vec_per_row; c += kThreads) yrow[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    for (int64_t c = threadIdx.x; c < vec_per_row; c += kThreads) {
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = 0.f;
      for (int k = 0; k < K; ++k) {
        const int32_t r = rows[k];
        if (r >= 0) combine_acc8(a, __ldg(out + int64_t(r) * vec_per_row + c), ws[k]);
      }
      if (shared_out) combine_acc8(a, __ldg(shared_out + t * vec_per_row + c), 1.0f);
      yrow[c] = combine_pack8(a);
    }
  }
}

}  // namespace

const char* launch_combine(const Problem& pr, const uint8_t* token_mask, const int32_t* pair_row,
                           const float* topk_weights, const void* out, const void* shared_out, void* y, int num_sms,
                           cudaStream_t stream) {
  if (pr.tokens <= 0) return nullptr;
  if (pr.top_k > kMaxK) return "mok cuda combine: top_k > 64 unsupported";
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(pr.tokens, int64_t(num_sms) * 16)));
  combine_tokens<<<grid, kThreads, 0, stream>>>(pr.tokens, pr.hidden / 8, static_cast<int>(pr.top_k), token_mask,
                                                pair_row, topk_weights, static_cast<const uint4*>(out),
                                                static_cast<const uint4*>(shared_out), static_cast<uint4*>(y));
  if (cudaGetLastError() != cudaSuccess) return "mok cuda combine: launch failed";
  return nullptr;
}

}  // namespace mok::cuda::detail
