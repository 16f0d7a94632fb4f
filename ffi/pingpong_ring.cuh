// What the two ping-pong kernels (gemm_wgmma_pingpong.cu: the forward's
// GEMMs; gemm_wgmma_bwd_pingpong.cu: the SwiGLU-backward dgrad) share: the
// shared-memory ring's barriers, the stage hand-back to both CTAs of the
// 2-CTA cluster, and the cluster launch. The scheme is described in
// gemm_wgmma_bwd_pingpong.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "cuda_ptx.cuh"
#include "gemm_tile.cuh"

namespace mok::cuda::pingpong {

constexpr int kHalfRows = tile::kBM / 2;                         // a CTA's rows of a unit
constexpr int kWarpsPerStage = 2 * (tile::kConsumerWarps / 2);  // one warpgroup of each CTA
static_assert(3 * tile::kStages * 8 <= 1024, "the full (x2) and empty barriers fit before the staging");

struct Ring {
  uint8_t* smem;        // 1024-aligned: the stages, then the barriers, then the staging
  uint64_t* full_bar;   // kStages per consumer warpgroup: warpgroup cw's at cw * kStages
  uint64_t* empty_bar;  // kStages, each counting one warpgroup of each CTA
};

// Aligns the dynamic shared memory, initialises the barriers and syncs the
// cluster, so the partner's barriers exist before any multicast or remote
// arrive. Every thread of the CTA calls it.
__device__ __forceinline__ Ring setup_ring(uint8_t* smem_raw) {
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + tile::kStages * tile::kStageBytes);
  uint64_t* empty_bar = full_bar + 2 * tile::kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < tile::kStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&full_bar[tile::kStages + s], 1);
      ptx::mbar_init(&empty_bar[s], kWarpsPerStage);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  ptx::cluster_sync();
  return {smem, full_bar, empty_bar};
}

// Hands stage s back to both CTAs' producers (lane 0 of each consumer warp);
// peer_empty: the partner's empty barriers, ptx::map_to_rank of ours.
__device__ __forceinline__ void release_stage(uint64_t* empty_bar, uint32_t peer_empty, uint32_t s, int lane) {
  if (lane == 0) {
    ptx::mbar_arrive(&empty_bar[s]);
    ptx::mbar_arrive_cluster(peer_empty + s * 8);
  }
}

// Launches `kern` on min(units, resident) 2-CTA clusters of tile::kThreads
// threads and `smem_bytes` of shared memory. `resident` caches, per kernel,
// the clusters that fit at once (queried on first use; one cluster per two
// SMs when the query fails). Returns an error message or nullptr.
template <typename Kernel, typename... Args>
const char* launch_clusters(Kernel* kern, std::atomic<int>& resident, int smem_bytes, int64_t units, int num_sms,
                            cudaStream_t stream, const char* what, Args... args) {
  // Every launch (the attribute is per device), before the occupancy query.
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess) return what;
  if (units <= 0) return nullptr;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(tile::kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (resident.load() < 0) {
    cfg.gridDim = dim3(2 * std::max(1, num_sms / 2), 1, 1);
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      n = 0;
    }
    resident.store(n);
  }
  const int max_clusters = resident.load() > 0 ? resident.load() : std::max(1, num_sms / 2);
  cfg.gridDim = dim3(2 * static_cast<int>(std::min<int64_t>(units, max_clusters)), 1, 1);
  if (cudaLaunchKernelEx(&cfg, kern, args...) != cudaSuccess || cudaGetLastError() != cudaSuccess) return what;
  return nullptr;
}

}  // namespace mok::cuda::pingpong
