// Dispatch on the GPU: gather token rows into the padded expert-major buffer.
//   xg[r] = x[row_pair[r] / K]   for real rows,
//   xg[r] = 0                    for padding rows below expert_offsets[E].
// Rows at or above expert_offsets[E] are left untouched (their GEMM tiles are
// skipped). 16-byte vectors (H % 8 == 0). Two kernels:
//   dispatch_tokens  one warp per token (the default): its row read once and
//                    written to its K rows (pair_row), then the padding rows
//                    zeroed: at shape 1, 1.2 GB of DRAM traffic instead of ~2 GB.
//   dispatch_rows    one warp per destination row (MOK_CUDA_DISPATCH=rows):
//                    a token's row is read K times, from DRAM mostly (x is
//                    larger than L2 at the benchmark shapes; ncu of the same
//                    copy in the peer pull: 0.95 GB read for 1.07 GB of rows).
// Every destination row is written by one warp: deterministic either way.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "dispatch_row.cuh"
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
    copy_row_warp(p >= 0 ? x + (int64_t(p) / K) * vec_per_row : nullptr, xg + r * vec_per_row, vec_per_row, lane);
  }
}

// Warp items [0, T): token t's row, read once in chunks of 4 vectors per lane
// and stored to each of its rows pair_row[t K + k] (-1: masked, no row);
// items [T, T + ceil(R / 32)): 32 rows each, the padding ones (row_pair < 0,
// below expert_offsets[E]) zeroed.
__global__ void __launch_bounds__(kThreads) dispatch_tokens(const uint4* __restrict__ x, int64_t vec_per_row, int K,
                                                            int64_t tokens, const int32_t* __restrict__ pair_row,
                                                            const int32_t* __restrict__ row_pair,
                                                            const int32_t* __restrict__ total_rows,
                                                            int64_t row_groups, uint4* __restrict__ xg) {
  const int64_t total = *total_rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t items = tokens + row_groups;
  for (int64_t w = int64_t(blockIdx.x) * kRowsPerBlock + warp; w < items; w += int64_t(gridDim.x) * kRowsPerBlock) {
    if (w < tokens) {
      const uint4* src = x + w * vec_per_row;
      const int32_t* rows = pair_row + w * K;
      for (int64_t c0 = 0; c0 < vec_per_row; c0 += 128) {
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t c = c0 + lane + 32 * i;
          if (c < vec_per_row) v[i] = __ldg(src + c);
        }
        for (int kb = 0; kb < K; kb += 32) {
          // lane j holds the row of pair kb + j; broadcast one at a time
          const int32_t mine = kb + lane < K ? __ldg(rows + kb + lane) : -1;
          const int n = min(32, K - kb);
          for (int j = 0; j < n; ++j) {
            const int32_t r = __shfl_sync(0xffffffffu, mine, j);
            if (r < 0) continue;
            uint4* dst = xg + int64_t(r) * vec_per_row;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int64_t c = c0 + lane + 32 * i;
              if (c < vec_per_row) dst[c] = v[i];
            }
          }
        }
      }
    } else {
      const int64_t r0 = (w - tokens) * 32;
      if (r0 >= total) continue;
      const bool pad = r0 + lane < total && row_pair[r0 + lane] < 0;
      uint32_t todo = __ballot_sync(0xffffffffu, pad);
      const uint4 z = make_uint4(0, 0, 0, 0);
      while (todo != 0) {
        const int j = __ffs(todo) - 1;
        todo &= todo - 1;
        uint4* dst = xg + (r0 + j) * vec_per_row;
        for (int64_t c = lane; c < vec_per_row; c += 32) dst[c] = z;
      }
    }
  }
}

// The token-major kernel unless MOK_CUDA_DISPATCH=rows (read once per process).
bool token_major_dispatch() {
  static const bool on = [] {
    const char* e = std::getenv("MOK_CUDA_DISPATCH");
    return e == nullptr || std::strcmp(e, "rows") != 0;
  }();
  return on;
}

}  // namespace

bool fused_dispatch_enabled(bool keeps_residuals, int64_t hidden) {
  // -1: unset (the default below), 0: the separate kernel, 1: fused.
  static const int forced = [] {
    const char* e = std::getenv("MOK_CUDA_FUSED_DISPATCH");
    if (e == nullptr || *e == '\0') return -1;
    return std::strcmp(e, "0") == 0 ? 0 : 1;
  }();
  // Default: fused only in the forward that keeps no residuals, where it
  // measured faster with the 8 MB window (twenty-fourth session, H100: -3.3 %
  // at shape 1, -1.9 % at shape 2, level at shape 4), and only up to
  // kMaxFusedDispatchHidden: at H = 7168 (a 128-row tile of 1.8 MB) the copy
  // slows the gate/up GEMM by more than the dispatch kernel costs (twenty-sixth
  // session, H100, through JAX: 5.68 against 5.14 ms at shape 3). The training
  // forward's ping-pong gate/up measured slower with it (twenty-third
  // session), and the cooperative one level through JAX (twenty-sixth), so the
  // training forward keeps the separate kernel.
  if (forced >= 0) return forced == 1;
  return !keeps_residuals && hidden <= kMaxFusedDispatchHidden;
}

int fused_dispatch_window_tiles(int64_t hidden) {
  static const int64_t mb = [] {
    const char* e = std::getenv("MOK_CUDA_FUSED_DISPATCH_WINDOW_MB");
    return e != nullptr && *e != '\0' ? static_cast<int64_t>(std::max(0, std::atoi(e)))
                                      : kDefaultFusedDispatchWindowMB;
  }();
  if (mb == 0) return 0;
  return static_cast<int>(std::max<int64_t>(4, (mb << 20) / (kTileRows * hidden * 2)));  // bf16 rows
}

const char* launch_dispatch(const Problem& pr, const void* x, const int32_t* row_pair, const int32_t* pair_row,
                            const int32_t* expert_offsets, void* xg, int num_sms, cudaStream_t stream) {
  const int64_t R = pr.row_capacity();
  const int64_t vec = pr.hidden / 8;
  const bool tokens = token_major_dispatch();
  const int64_t groups = (R + 31) / 32;  // dispatch_tokens' padding items
  const int64_t warp_items = tokens ? pr.tokens + groups : R;
  const int64_t want = (warp_items + kRowsPerBlock - 1) / kRowsPerBlock;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(num_sms) * 8)));
  const uint4* src = static_cast<const uint4*>(x);
  uint4* dst = static_cast<uint4*>(xg);
  const int K = static_cast<int>(pr.top_k);
  if (tokens)
    dispatch_tokens<<<grid, kThreads, 0, stream>>>(src, vec, K, pr.tokens, pair_row, row_pair,
                                                   expert_offsets + pr.experts, groups, dst);
  else
    dispatch_rows<<<grid, kThreads, 0, stream>>>(src, vec, K, row_pair, expert_offsets + pr.experts, dst);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda dispatch: launch failed";
  return nullptr;
}

}  // namespace mok::cuda::detail
