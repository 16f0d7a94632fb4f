// The dispatch fused into the gate/up GEMM (gemm_wgmma.cu's cooperative kernel
// and gemm_wgmma_pingpong.cu's):
// the producer warpgroup's three warps that do not issue TMA loads copy the
// token rows into the expert-major buffer the GEMM then reads through TMA,
//   xg[r] = x[row_pair[r] / K]  (zeros where row_pair[r] < 0),  r < *total_rows,
// the same bytes dispatch.cu's kernels write (copy_row_warp), so the results
// are bitwise the same. The copy runs under the GEMM instead of before it (the separate
// kernel is ~0.5 ms of DRAM traffic at shape 1, ~10 % of the forward).
//
// Protocol (int32 sync[2 + m_tiles], zero at launch):
//   sync[0]      ticket: a warp claims the next kCopyRows-row chunk, in row
//                order, so the copy front moves through the tiles in the
//                order the persistent loop first needs them;
//   sync[1]      the GEMM's front: 1 + the highest tile a TMA thread started;
//   sync[2 + m]  chunks of 128-row tile m copied (release after the
//                chunk's stores); the TMA thread waits for kChunksPerTile
//                (acquire) and fences the async proxy before loading tile m.
// Throttle (window_tiles > 0): a warp holding a chunk of tile m waits while
// m >= front + window_tiles, so the copied rows are still in L2 when TMA
// reads them; the wait gives up after kThrottleNs, so it only paces the
// copy. A claimed chunk is always finished, so every wait of a TMA thread
// ends as long as one CTA runs (no co-residency assumption).
#pragma once

#include <cstdint>

#include "dispatch_row.cuh"
#include "gemm_tile.cuh"
#include "gemm_wgmma.cuh"
#include "megakernel_sync.cuh"

namespace mok::cuda::fused_dispatch {

constexpr int kTileRows = tile::kBM;          // the counters' tiles: the GEMM's M tiles
constexpr int kCopyRows = 4;                  // rows per claimed chunk
constexpr int kChunksPerTile = kTileRows / kCopyRows;
constexpr uint64_t kThrottleNs = 50 * 1000;   // the longest a chunk waits for the GEMM's front

// One warp (lane = its lane) of the copy role, until no chunk is left.
__device__ __forceinline__ void copy_role(const FusedDispatchParams& f, int lane) {
  const int n_chunks = *f.total_rows / kCopyRows;
  for (;;) {
    int j = 0;
    if (lane == 0) j = atomicAdd(&f.sync[0], 1);
    j = __shfl_sync(0xffffffffu, j, 0);
    if (j >= n_chunks) break;
    const int r0 = j * kCopyRows;
    if (f.window_tiles > 0 && lane == 0) {
      const int m = r0 / kTileRows;
      const volatile int32_t* front = f.sync + 1;
      if (m >= *front + f.window_tiles) {
        const uint64_t t0 = sync::global_ns();
        while (m >= *front + f.window_tiles && sync::global_ns() - t0 < kThrottleNs) __nanosleep(256);
      }
    }
    __syncwarp();
    // The chunk's source tokens in one load (lane i < kCopyRows: row r0 + i's
    // token, -1 for padding), broadcast below.
    int32_t mine = lane < kCopyRows ? __ldg(f.row_pair + r0 + lane) : -1;
    mine = mine >= 0 ? mine / f.top_k : -1;
    // The 40-register producer holds only 4 loads per lane (copy_row_warp), so
    // the chunk's source rows are first requested into L2 all at once
    // (prefetches hold no registers); the copy below then mostly hits L2.
#pragma unroll 1
    for (int rr = 0; rr < kCopyRows; ++rr) {
      const int32_t tok = __shfl_sync(0xffffffffu, mine, rr);
      if (tok >= 0) {
        const uint4* src = f.x + static_cast<int64_t>(tok) * f.vec;
#pragma unroll 1
        for (int line = lane * 8; line < f.vec; line += 32 * 8)  // 8 vectors per 128-byte line
          asm volatile("prefetch.global.L2 [%0];" ::"l"(src + line));
      }
    }
#pragma unroll 1
    for (int rr = 0; rr < kCopyRows; ++rr) {
      const int32_t tok = __shfl_sync(0xffffffffu, mine, rr);
      copy_row_warp(tok >= 0 ? f.x + static_cast<int64_t>(tok) * f.vec : nullptr,
                    f.dst + static_cast<int64_t>(r0 + rr) * f.vec, f.vec, lane);
    }
    // The warp's stores, then one release per chunk (the pattern of the
    // megakernel's ready counters: barrier, fence, release).
    __syncwarp();
    if (lane == 0) {
      __threadfence();
      sync::red_release_add(&f.sync[2 + r0 / kTileRows], 1);
    }
  }
}

// The TMA thread, before its first load of 128-row tile m.
__device__ __forceinline__ void wait_tile(const FusedDispatchParams& f, int m) {
  sync::wait_at_least(&f.sync[2 + m], kChunksPerTile, f.flags);
  sync::fence_proxy_async_global();  // rows other warps wrote, read next by TMA
  if (f.window_tiles > 0) atomicMax(f.sync + 1, m + 1);  // the throttle's front
}

}  // namespace mok::cuda::fused_dispatch
