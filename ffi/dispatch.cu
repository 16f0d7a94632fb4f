// Dispatch on the GPU: gather token rows into the padded expert-major buffer.
//   xg[r] = x[row_pair[r] / K]   for real rows,
//   xg[r] = 0                    for padding rows below expert_offsets[E].
// Rows at or above expert_offsets[E] are left untouched (their GEMM tiles are
// skipped). One warp per row, 16-byte vectors (H % 8 == 0).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "forward_cuda.h"

namespace mok::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;

__global__ void __launch_bounds__(kThreads) dispatch_rows(const uint4* __restrict__ x, int64_t vec_per_row, int K,
                                                          const int32_t* __restrict__ row_pair,
                                                          const int32_t* __restrict__ total_rows,
                                                          uint4* __restrict__ xg) {
  const int64_t total = *total_rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + warp; r < total; r += int64_t(gridDim.x) * kRowsPerBlock) {
    const int32_t p = row_pair[r];
    uint4* dst = xg + r * vec_per_row;
    if (p >= 0) {
      const uint4* src = x + (int64_t(p) / K) * vec_per_row;
      int64_t c = lane;
      // 4 independent 16-byte loads in flight per lane.
      for (; c + 96 < vec_per_row; c += 128) {
        const uint4 v0 = __ldg(src + c), v1 = __ldg(src + c + 32), v2 = __ldg(src + c + 64), v3 = __ldg(src + c + 96);
        dst[c] = v0;
        dst[c + 32] = v1;
        dst[c + 64] = v2;
        dst[c + 96] = v3;
      }
      for (; c < vec_per_row; c += 32) dst[c] = __ldg(src + c);
    } else {
      const uint4 z = make_uint4(0, 0, 0, 0);
      for (int64_t c = lane; c < vec_per_row; c += 32) dst[c] = z;
    }
  }
}

}  // namespace

const char* launch_dispatch(const Problem& pr, const void* x, const int32_t* row_pair, const int32_t* expert_offsets,
                            void* xg, int num_sms, cudaStream_t stream) {
  const int64_t R = pr.row_capacity();
  const int64_t vec = pr.hidden / 8;
  const int64_t want = (R + kRowsPerBlock - 1) / kRowsPerBlock;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(num_sms) * 8)));
  dispatch_rows<<<grid, kThreads, 0, stream>>>(static_cast<const uint4*>(x), vec, static_cast<int>(pr.top_k), row_pair,
                                               expert_offsets + pr.experts, static_cast<uint4*>(xg));
  if (cudaGetLastError() != cudaSuccess) return "mok cuda dispatch: launch failed";
  return nullptr;
}

}  // namespace mok::cuda::detail
