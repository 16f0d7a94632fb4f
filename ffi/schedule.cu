// Schedule on the GPU: count -> pad -> place, deterministic, no sort, no host sync.
//
// Pairs p = t*K + k are split into blocks of kPairsPerBlock, each block into
// kWarps contiguous warp ranges of kPairsPerWarp. Every "slot" (block, warp)
// counts its pairs per expert; an exclusive scan over slots (in slot order, which
// is pair order) gives each slot's first position inside every expert, so the
// rows of one expert come out in increasing pair index. Inside a warp, rounds of
// 32 consecutive pairs are ranked with __match_any_sync (lane order = pair order).
//
//   1. schedule_count  : per-slot histograms hist[slot][e]; row_pair[:] = -1;
//                        invalid expert ids -> flags[0] |= 1.
//   2. schedule_scan   : per expert, exclusive scan of hist over slots (in place);
//                        counts[e] = total.
//   3. schedule_offsets: padded exclusive scan over experts -> expert_offsets;
//                        tile_expert[tile] = expert of each 128-row tile or -1;
//                        also zeroes the caller's zero_words (counters a later
//                        kernel of the stream needs at zero: one memset node fewer).
//   4. schedule_place  : pair_row[p], row_pair[row].
#include <cuda_runtime.h>

#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "forward_cuda.h"

namespace mok::cuda::detail {
namespace {

constexpr int kWarps = 8;
constexpr int kPairsPerWarp = 512;
constexpr int kPairsPerBlock = kWarps * kPairsPerWarp;
constexpr int kRounds = kPairsPerWarp / 32;

// The experts this schedule places: global ids [base, base + E) of all_experts
// (base = 0, all_experts = E at EP = 1; one rank's slice under the peer
// dispatch, which schedules every rank's pairs for its own experts).
struct ExpertWindow {
  int base;
  int all_experts;
};

// Local expert (id - base) of pair p, or -1 when the pair is not routed here
// (masked token, bad id, or another rank's expert).
__device__ __forceinline__ int pair_expert(const int32_t* __restrict__ ids, const uint8_t* __restrict__ mask,
                                           int64_t p, int64_t P, int K, int E, ExpertWindow w, int32_t* flags) {
  if (p >= P) return -1;
  const int64_t t = p / K;
  if (mask[t] == 0) return -1;
  const int e = ids[p];
  if (e < 0 || e >= w.all_experts) {
    atomicOr(flags, 1);
    return -1;
  }
  const int local = e - w.base;
  return (local >= 0 && local < E) ? local : -1;
}

__global__ void schedule_count(const int32_t* __restrict__ ids, const uint8_t* __restrict__ mask, int64_t P,
                               int K, int E, ExpertWindow win, int64_t R, int32_t* __restrict__ hist,
                               int32_t* __restrict__ row_pair, int32_t* flags) {
  extern __shared__ int32_t wcnt[];  // [kWarps][E]
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x) wcnt[i] = 0;
  // row_pair = -1 everywhere (the place kernel, launched later, fills real rows).
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < R; r += int64_t(gridDim.x) * blockDim.x)
    row_pair[r] = -1;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t base = int64_t(blockIdx.x) * kPairsPerBlock + int64_t(warp) * kPairsPerWarp;
  int32_t* my = wcnt + warp * E;
  for (int r = 0; r < kRounds; ++r) {
    const int64_t p = base + r * 32 + lane;
    const int e = pair_expert(ids, mask, p, P, K, E, win, flags);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(same) - 1) my[e] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x)
    hist[(int64_t(blockIdx.x) * kWarps) * E + i] = wcnt[i];
}

// grid.x = ceil(E/32), block (32, 32): tx = expert within the block, ty = slot segment.
__global__ void schedule_scan(int32_t* __restrict__ hist, int64_t slots, int E, int32_t* __restrict__ counts) {
  __shared__ int32_t part[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int e = blockIdx.x * 32 + tx;
  const int64_t seg = (slots + 31) / 32;
  const int64_t s0 = ty * seg;
  const int64_t s1 = (s0 + seg < slots) ? s0 + seg : slots;
  int32_t sum = 0;
  if (e < E)
    for (int64_t s = s0; s < s1; ++s) sum += hist[s * E + e];
  part[ty][tx] = sum;
  __syncthreads();
  if (ty == 0) {
    int32_t run = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t v = part[i][tx];
      part[i][tx] = run;
      run += v;
    }
    if (e < E) counts[e] = run;
  }
  __syncthreads();
  if (e < E) {
    int32_t run = part[ty][tx];
    for (int64_t s = s0; s < s1; ++s) {
      const int32_t v = hist[s * E + e];
      hist[s * E + e] = run;
      run += v;
    }
  }
}

constexpr int kOffThreads = 1024;

__global__ void __launch_bounds__(kOffThreads) schedule_offsets(const int32_t* __restrict__ counts, int E, int tile,
                                                                int64_t R, int32_t* __restrict__ expert_offsets,
                                                                int32_t* __restrict__ tile_expert,
                                                                int32_t* __restrict__ zero_words, int64_t zero_count) {
  // zero_words: see the file comment (the fused dispatch's counters).
  for (int64_t i = threadIdx.x; i < zero_count; i += kOffThreads) zero_words[i] = 0;
  using Scan = cub::BlockScan<int32_t, kOffThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int32_t carry_s;
  int32_t carry = 0;
  for (int c0 = 0; c0 < E; c0 += kOffThreads) {
    const int e = c0 + threadIdx.x;
    const int32_t v = e < E ? (counts[e] + tile - 1) / tile * tile : 0;
    int32_t excl, agg;
    Scan(tmp).ExclusiveSum(v, excl, agg);
    if (e < E) expert_offsets[e] = carry + excl;
    carry += agg;
    __syncthreads();  // tmp reuse
  }
  if (threadIdx.x == 0) {
    expert_offsets[E] = carry;
    carry_s = carry;
  }
  __syncthreads();  // expert_offsets visible block-wide
  const int32_t total = carry_s;
  for (int e = threadIdx.x; e < E; e += kOffThreads) {
    const int32_t t0 = expert_offsets[e] / tile, t1 = (e + 1 < E ? expert_offsets[e + 1] : total) / tile;
    for (int32_t t = t0; t < t1; ++t) tile_expert[t] = e;
  }
  const int64_t tiles = R / tile;
  for (int64_t t = total / tile + threadIdx.x; t < tiles; t += kOffThreads) tile_expert[t] = -1;
}

__global__ void schedule_place(const int32_t* __restrict__ ids, const uint8_t* __restrict__ mask, int64_t P, int K,
                               int E, ExpertWindow win, const int32_t* __restrict__ hist,
                               const int32_t* __restrict__ expert_offsets,
                               int32_t* __restrict__ pair_row, int32_t* __restrict__ row_pair, int32_t* flags) {
  extern __shared__ int32_t wrun[];  // [kWarps][E] next row of each expert for each warp
  const int64_t slot0 = int64_t(blockIdx.x) * kWarps;
  for (int i = threadIdx.x; i < kWarps * E; i += blockDim.x)
    wrun[i] = expert_offsets[i % E] + hist[slot0 * E + i];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t base = int64_t(blockIdx.x) * kPairsPerBlock + int64_t(warp) * kPairsPerWarp;
  int32_t* my = wrun + warp * E;
  const unsigned lt = (1u << lane) - 1u;
  for (int r = 0; r < kRounds; ++r) {
    const int64_t p = base + r * 32 + lane;
    // (a bad id raises flags again here: same bit, harmless)
    const int e = pair_expert(ids, mask, p, P, K, E, win, flags);
    const unsigned same = __match_any_sync(0xffffffffu, e);
    int32_t row = -1;
    if (e >= 0) row = my[e] + __popc(same & lt);
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) my[e] += __popc(same);
    __syncwarp();
    if (p < P) {
      pair_row[p] = row;
      if (row >= 0) row_pair[row] = static_cast<int32_t>(p);
    }
  }
}

}  // namespace

int64_t schedule_slots(const Problem& pr) {
  const int64_t blocks = std::max<int64_t>(1, (pr.pairs() + kPairsPerBlock - 1) / kPairsPerBlock);
  return blocks * kWarps;
}

const char* launch_schedule(const Problem& pr, const int32_t* topk_ids, const uint8_t* token_mask,
                            int32_t* expert_offsets, int32_t* row_pair, int32_t* pair_row, int32_t* hist,
                            int32_t* counts, int32_t* tile_expert, int32_t* flags, cudaStream_t stream,
                            int expert_base, int all_experts, int32_t* zero_words, int64_t zero_count) {
  const int64_t P = pr.pairs();
  const int E = static_cast<int>(pr.experts);
  const int K = static_cast<int>(pr.top_k);
  const int64_t R = pr.row_capacity();
  const int64_t slots = schedule_slots(pr);
  const ExpertWindow win{expert_base, all_experts > 0 ? all_experts : E};
  if (expert_base < 0 || expert_base + E > win.all_experts) return "mok cuda schedule: bad expert window";
  if (zero_count < 0 || (zero_count > 0 && zero_words == nullptr)) return "mok cuda schedule: bad zero_words";
  const int blocks = static_cast<int>(slots / kWarps);
  const size_t smem = size_t(kWarps) * E * sizeof(int32_t);
  if (smem > 200 * 1024) return "mok cuda schedule: too many experts";
  if (smem > 48 * 1024) {
    if (cudaFuncSetAttribute(schedule_count, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess ||
        cudaFuncSetAttribute(schedule_place, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) != cudaSuccess)
      return "mok cuda schedule: cudaFuncSetAttribute failed";
  }
  if (cudaMemsetAsync(flags, 0, sizeof(int32_t), stream) != cudaSuccess) return "mok cuda schedule: memset failed";
  schedule_count<<<blocks, kWarps * 32, smem, stream>>>(topk_ids, token_mask, P, K, E, win, R, hist, row_pair, flags);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda schedule: count launch failed";
  schedule_scan<<<(E + 31) / 32, dim3(32, 32), 0, stream>>>(hist, slots, E, counts);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda schedule: scan launch failed";
  schedule_offsets<<<1, kOffThreads, 0, stream>>>(counts, E, static_cast<int>(pr.tile_rows), R, expert_offsets,
                                                  tile_expert, zero_words, zero_count);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda schedule: offsets launch failed";
  schedule_place<<<blocks, kWarps * 32, smem, stream>>>(topk_ids, token_mask, P, K, E, win, hist, expert_offsets,
                                                        pair_row, row_pair, flags);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda schedule: place launch failed";
  return nullptr;
}

}  // namespace mok::cuda::detail
