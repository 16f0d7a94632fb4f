// Grouped wgmma GEMM (see gemm_wgmma.cuh).
#include "gemm_wgmma.cuh"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "cuda_problem.h"
#include "cuda_ptx.cuh"
#include "dispatch_fused.cuh"
#include "gemm_tile.cuh"

namespace mok::cuda {

// ------------------------------------------------------------------ host side
namespace {
PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;
std::once_flag g_encode_once;
}  // namespace

PFN_cuTensorMapEncodeTiled_v12000 get_encoder() {
  std::call_once(g_encode_once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      g_encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
  });
  return g_encode;
}

bool make_map_2d(CUtensorMap* m, const void* ptr, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                 CUtensorMapSwizzle swizzle) {
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t estr[2] = {1, 1};
  return get_encoder()(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, estr,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool make_map_3d_rows(CUtensorMap* m, const void* ptr, int64_t groups, int64_t rows, int64_t cols, uint32_t box_cols,
                      uint32_t box_rows) {
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(groups)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2, static_cast<cuuint64_t>(rows) * cols * 2};
  cuuint32_t box[3] = {box_cols, box_rows, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  return get_encoder()(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(ptr), dims, strides, box, estr,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool make_map_a(CUtensorMap* m, const void* ptr, int64_t rows, int64_t k) {
  return make_map_2d(m, ptr, rows, k, tile::kBK, tile::kBM);
}

bool make_map_b(CUtensorMap* m, const void* ptr, int64_t groups, int64_t k, int64_t n) {
  return make_map_3d_rows(m, ptr, groups, k, n, 64, tile::kBK);
}

namespace {

using tile::kABytes;
using tile::kBChunk;
using tile::kBK;
using tile::kBM;
using tile::kConsumerWarps;
using tile::kStageBytes;
using tile::kStages;
using tile::kThreads;

// The TMA-store epilogue (tile::TmaTileStore, the default) needs
// tile::kTmaGemmSmemBytes of shared memory; a -DMOK_GEMM_TMA_STORE=0 build
// has the register-to-global stores only (tile::TileStore, tile::kSmemBytes).
constexpr int kKernelSmemBytes = tile::kStagedGemmSmemBytes;

struct KParams {
  int m_rows;
  int n;
  int k_blocks;
  int n_tiles;
  int m_tiles;
  int group_m;  // rasterisation band (tile::raster), in cluster units
  const int32_t* tile_group;
  const uint8_t* row_mask;
  __nv_bfloat16* out0;
  __nv_bfloat16* out1;
  __nv_bfloat16* out2;
  const uint64_t* row_dst;  // kStore: per-row destinations, or nullptr
  int zero_unused;
#if MOK_GEMM_TMA_STORE
  int tma_store;  // epilogue through TMA stores (tm_out*; not with row_dst)
#endif
  FusedDispatchParams fd;  // fd.x != nullptr: A's rows are copied in this kernel
};

#if MOK_GEMM_WAIT_PROBE
// tile::WaitProbe sums of every probed consumer warpgroup: [0] gate/up, [1] plain.
__device__ unsigned long long g_wait_probe[2][8];
#endif

// kCluster = 1: one CTA per 128-row tile.
// kCluster = 2: clusters of 2 CTAs on adjacent 128-row tiles (2i, 2i+1) and the
// same N tile. When both tiles use the same weight group (the common case: rows
// are expert-major), each CTA loads half of the B stage and multicasts it to
// both, so the pair reads B once from L2. If one tile of the pair is unused, it
// borrows its partner's group and computes throw-away results, which keeps the
// two pipelines in lock-step; if the groups differ, each CTA loads its own B.
// The empty barrier of each stage then counts the consumer warps of both CTAs.
// kKeepPre = false (kFused only): the activation is the only output (out0 and
// out1, the gate/up pre-activations, are not written).
template <bool kFused, int kCluster, bool kKeepPre>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b0,
                        const __grid_constant__ CUtensorMap tm_b1,
#if MOK_GEMM_TMA_STORE
                        const __grid_constant__ CUtensorMap tm_out0, const __grid_constant__ CUtensorMap tm_out1,
                        const __grid_constant__ CUtensorMap tm_out2,
#endif
                        const KParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty_bar = full_bar + kStages;

  const int wg = threadIdx.x / 128;
  const uint32_t crank = kCluster > 1 ? ptx::cluster_ctarank() : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&empty_bar[s], kConsumerWarps * kCluster);
    }
    ptx::fence_barrier_init();
  }
  if (kCluster > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  const int cid = blockIdx.x / kCluster;
  const int ncl = gridDim.x / kCluster;
  const int m_units = (p.m_tiles + kCluster - 1) / kCluster;
  const int num_units = m_units * p.n_tiles;
  auto group_of = [&](int mt) -> int {
    if (mt >= p.m_tiles) return -1;
    return p.tile_group ? p.tile_group[mt] : 0;
  };

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (kFused && p.fd.x != nullptr && threadIdx.x >= 32) {
      // Warps 1-3: the fused dispatch (dispatch_fused.cuh).
      fused_dispatch::copy_role(p.fd, threadIdx.x & 31);
    } else if (threadIdx.x == 0) {
      ptx::tma_prefetch_desc(&tm_a);
      ptx::tma_prefetch_desc(&tm_b0);
      if (kFused) ptx::tma_prefetch_desc(&tm_b1);
      uint32_t it = 0;
      for (int u = cid; u < num_units; u += ncl) {
        const tile::TileCoord c = tile::raster(u, m_units, p.n_tiles, p.group_m);
        const int mu = c.mt, nt = c.nt;
        const int mt = mu * kCluster + static_cast<int>(crank);
        const int g_self = group_of(mt);
        const int g_peer = kCluster > 1 ? group_of(mu * kCluster + static_cast<int>(crank ^ 1)) : -1;
        if (g_self < 0 && g_peer < 0) continue;
        const int grp = g_self >= 0 ? g_self : g_peer;
        const int grp_peer = g_peer >= 0 ? g_peer : g_self;
        const bool mcast = kCluster > 1 && grp == grp_peer;
        // A used tile's rows are copied by this kernel: wait for them (while
        // the ring is still full of the previous tile's stages).
        if (kFused && p.fd.x != nullptr && g_self >= 0) fused_dispatch::wait_tile(p.fd, mt);
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          const uint32_t par = (it / kStages) & 1;
          ptx::mbar_wait(&empty_bar[s], par ^ 1);
          uint8_t* sa = smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          ptx::mbar_arrive_expect_tx(&full_bar[s], kStageBytes);
          ptx::tma_load_2d(sa, &tm_a, kb * kBK, mt * kBM, &full_bar[s]);
          // B chunk j (8 KB): 64 N columns x 64 K rows.
          auto load_b = [&](int j, bool multicast) {
            const CUtensorMap* map = (kFused && j >= 2) ? &tm_b1 : &tm_b0;
            const int ncol = kFused ? nt * 128 + (j & 1) * 64 : nt * 256 + j * 64;
            if (multicast)
              ptx::tma_load_3d_multicast(sb + j * kBChunk, map, ncol, kb * kBK, grp, &full_bar[s],
                                         static_cast<uint16_t>((1u << kCluster) - 1));
            else
              ptx::tma_load_3d(sb + j * kBChunk, map, ncol, kb * kBK, grp, &full_bar[s]);
          };
          if (mcast) {
            load_b(2 * crank, true);
            load_b(2 * crank + 1, true);
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) load_b(j, false);
          }
        }
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    ptx::setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int warp = (threadIdx.x / 32) & 3;
    const int lane = threadIdx.x & 31;
    uint8_t* stg = smem + tile::kStagedStgOffset + (cw * 4 + warp) * tile::kStagedStgWarpBytes;
#if MOK_GEMM_TMA_STORE
    const bool tma = p.tma_store != 0;
    tile::TmaTileStore tts{stg, lane, 0, {false, false}, 0u};
#endif
    // The partner's empty barriers, mapped once (one register for the loop).
    const uint32_t peer_empty = kCluster > 1 ? ptx::map_to_rank(ptx::smem_u32(empty_bar), crank ^ 1) : 0u;
    auto release = [&](uint32_t s) {
      if (lane == 0) {
        ptx::mbar_arrive(&empty_bar[s]);
        if (kCluster > 1) ptx::mbar_arrive_cluster(peer_empty + s * 8);
      }
    };
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    tile::WaitProbe wp{};  // MOK_GEMM_WAIT_PROBE builds only (else unused)
    const bool probe_on = MOK_GEMM_WAIT_PROBE && warp == 0 && lane == 0;
#if MOK_GEMM_WAIT_PROBE
    const long long t_begin = clock64();
#endif
    uint32_t it = 0;
    for (int u = cid; u < num_units; u += ncl) {
      const tile::TileCoord c = tile::raster(u, m_units, p.n_tiles, p.group_m);
      const int mu = c.mt, nt = c.nt;
      const int mt = mu * kCluster + static_cast<int>(crank);
      const int g_self = group_of(mt);
      const int g_peer = kCluster > 1 ? group_of(mu * kCluster + static_cast<int>(crank ^ 1)) : -1;
      const int row0 = mt * kBM + cw * 64 + warp * 16 + (lane >> 2);
      if (g_self < 0 && g_peer < 0) {  // no loads, no math
        if (p.zero_unused)
          tile::zero_warp_rows<kFused, kKeepPre>(row0, lane, nt * (kFused ? 128 : 256), p.m_rows, p.n, p.out0, p.out1,
                                                  p.out2);
        continue;
      }
      tile::mma_k_loop(acc, smem, full_bar, it, p.k_blocks, cw, release, &wp, probe_on);
#if MOK_GEMM_WAIT_PROBE
      wp.v[7] += 1;
#endif

      // ---------------------------------------------------------- epilogue
      const bool unused = g_self < 0;  // computed only to keep the pair in lock-step
      if (unused && !p.zero_unused) continue;
      const int wrow0 = mt * kBM + cw * 64 + warp * 16;  // first row of this warp
      tile::TileStore ts{stg, lane, wrow0, p.m_rows, p.n, {false, false}, p.row_dst};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + h * 8;
        ts.keep[h] = !unused && row < p.m_rows && (p.row_mask == nullptr || p.row_mask[row] != 0);
      }
#if MOK_GEMM_TMA_STORE
      if (tma) {
        tts.wrow0 = wrow0;
        tts.keep[0] = ts.keep[0], tts.keep[1] = ts.keep[1];
        if (kFused) {
          tile::store_gate_up<kKeepPre>(acc, tts, nt * 128, &tm_out0, &tm_out1, &tm_out2);
        } else {
          tile::store_plain(acc, tts, nt * 256, &tm_out0);
        }
        continue;
      }
#endif
      if (kFused) {
        tile::store_gate_up<kKeepPre>(acc, ts, nt * 128, p.out0, p.out1, p.out2);
      } else {
        tile::store_plain(acc, ts, nt * 256, p.out0);
      }
    }
#if MOK_GEMM_TMA_STORE
    if (tma) tts.drain();
#endif
#if MOK_GEMM_WAIT_PROBE
    if (probe_on) {
      wp.v[6] = static_cast<unsigned long long>(clock64() - t_begin);
#pragma unroll
      for (int i = 0; i < 8; ++i) atomicAdd(&g_wait_probe[kFused ? 0 : 1][i], wp.v[i]);
    }
#endif
  }
  // No CTA of a cluster may exit while its partner can still arrive on its
  // barriers or multicast into its shared memory.
  if (kCluster > 1) {
    __syncwarp();
    ptx::cluster_sync();
  }
}

// Cluster size of the GEMM launches: 2 (B multicast across CTA pairs: half the
// L2 reads of the weights; on the H200 level with single CTAs at shape 1 and
// ~1 % faster at Mixtral, same device call) unless MOK_CUDA_GEMM_CLUSTER=1.
int gemm_cluster_size() {
  static const int v = [] {
    const char* e = std::getenv("MOK_CUDA_GEMM_CLUSTER");
    return (e != nullptr && std::atoi(e) == 1) ? 1 : 2;
  }();
  return v;
}

// Persistent grid: as many clusters as can be resident at once, queried once per
// kernel variant (assumes one device type per process); 0 when the query fails.
template <bool kFused, int kCluster, bool kKeepPre = true>
int resident_clusters(int num_sms) {
  static std::atomic<int> cached{-1};
  if (cached.load() < 0) {
    auto* kern = grouped_gemm_kernel<kFused, kCluster, kKeepPre>;
    int n = 0;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(kCluster * std::max(1, num_sms / kCluster), 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kKernelSmemBytes;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    bool ok = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kKernelSmemBytes) == cudaSuccess;
    if (ok && kCluster == 1) {
      ok = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, kThreads, kKernelSmemBytes) == cudaSuccess;
      n *= num_sms;
    } else if (ok) {
      ok = cudaOccupancyMaxActiveClusters(&n, kern, &cfg) == cudaSuccess;
    }
    if (!ok || n <= 0) {
      (void)cudaGetLastError();
      n = 0;
    }
    cached.store(n);
  }
  return cached.load();
}

template <bool kFused, int kCluster, bool kKeepPre>
const char* launch_kernel(const CUtensorMap& tm_a, const CUtensorMap& tm_b0, const CUtensorMap& tm_b1,
                          const CUtensorMap (&tm_out)[3], const KParams& p, int num_sms, cudaStream_t stream) {
  auto* kern = grouped_gemm_kernel<kFused, kCluster, kKeepPre>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kKernelSmemBytes) != cudaSuccess)
    return "mok cuda gemm: cudaFuncSetAttribute failed";
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = kKernelSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = kCluster > 1 ? 1 : 0;
  int max_clusters = resident_clusters<kFused, kCluster, kKeepPre>(num_sms);
  if (max_clusters <= 0) max_clusters = std::max(1, num_sms / kCluster);
  const int64_t units = int64_t((p.m_tiles + kCluster - 1) / kCluster) * p.n_tiles;
  if (units <= 0) return nullptr;
  const int clusters = static_cast<int>(std::min<int64_t>(units, max_clusters));
  cfg.gridDim = dim3(clusters * kCluster, 1, 1);
#if MOK_GEMM_TMA_STORE
  const cudaError_t launched = cudaLaunchKernelEx(&cfg, kern, tm_a, tm_b0, tm_b1, tm_out[0], tm_out[1], tm_out[2], p);
#else
  (void)tm_out;
  const cudaError_t launched = cudaLaunchKernelEx(&cfg, kern, tm_a, tm_b0, tm_b1, p);
#endif
  if (launched != cudaSuccess)
    return "mok cuda gemm: kernel launch failed";
  if (cudaGetLastError() != cudaSuccess) return "mok cuda gemm: kernel launch failed";
  return nullptr;
}

}  // namespace

int grouped_gemm_smem_bytes() { return kKernelSmemBytes; }

bool gemm_wait_probe_read(unsigned long long out[16]) {
#if MOK_GEMM_WAIT_PROBE
  return cudaMemcpyFromSymbol(out, g_wait_probe, sizeof(g_wait_probe)) == cudaSuccess;
#else
  (void)out;
  return false;
#endif
}

int grouped_gemm_resident_clusters(GemmEpilogue epi, int cluster, int num_sms) {
  const bool fused = epi == GemmEpilogue::kGateUpSwiGLU;
  if (cluster == 2) return fused ? resident_clusters<true, 2>(num_sms) : resident_clusters<false, 2>(num_sms);
  return fused ? resident_clusters<true, 1>(num_sms) : resident_clusters<false, 1>(num_sms);
}

// In a -DMOK_GEMM_TMA_STORE=1 build the epilogue stores through TMA (tile::TmaTileStore)
// unless MOK_CUDA_GEMM_TMA_STORE=0 (register-to-global stores: an A/B in one
// binary).
int gemm_tma_store() {
  static const int v = [] {
    const char* e = std::getenv("MOK_CUDA_GEMM_TMA_STORE");
    return (e != nullptr && std::atoi(e) == 0) ? 0 : 1;
  }();
  return v;
}

// Rasterisation band of every persistent GEMM loop (tile::raster): 8 unless
// MOK_CUDA_GEMM_GROUP_M overrides it (1 = plain m-major order), for measurement.
int gemm_group_m() {
  static const int v = [] {
    const char* e = std::getenv("MOK_CUDA_GEMM_GROUP_M");
    const int g = e != nullptr ? std::atoi(e) : 0;
    return g >= 1 && g <= 64 ? g : 8;
  }();
  return v;
}

const char* launch_grouped_gemm(GemmEpilogue epi, const GroupedGemmArgs& a, int num_sms, cudaStream_t stream) {
  const bool fused = epi == GemmEpilogue::kGateUpSwiGLU;
  if (a.m_rows <= 0) return nullptr;  // nothing to do
  if (a.k <= 0 || a.n <= 0 || a.k % 8 != 0 || a.n % 8 != 0) return "mok cuda gemm: k and n must be positive multiples of 8";
  if (a.m_rows > (int64_t(1) << 31) - kBM || a.k > (int64_t(1) << 31) || a.n > (int64_t(1) << 31) ||
      a.groups > (int64_t(1) << 31))
    return "mok cuda gemm: dimension too large";
  // The fused epilogue without out0/out1: the activation only (keep_pre false).
  const bool keep_pre = !fused || a.out0 != nullptr || a.out1 != nullptr;
  if (fused && (a.out2 == nullptr || (keep_pre && (a.out0 == nullptr || a.out1 == nullptr))))
    return "mok cuda gemm: the gate/up epilogue needs out2, and out0 and out1 both or neither";
  if (a.row_dst != nullptr && (fused || a.zero_unused_tiles))
    return "mok cuda gemm: row_dst needs the plain epilogue without zero_unused_tiles";
  if (!aligned16(a.a) || !aligned16(a.b0) || (a.row_dst == nullptr && !aligned16(a.out0)) ||
      (fused && (!aligned16(a.b1) || !aligned16(a.out1) || !aligned16(a.out2))))
    return "mok cuda gemm: pointers must be 16-byte aligned";
  const FusedDispatchParams& fd = a.dispatch;
  if (fd.x != nullptr && (!fused || fd.row_pair == nullptr || fd.total_rows == nullptr || fd.sync == nullptr ||
                          fd.flags == nullptr || fd.top_k < 1 || !aligned16(fd.x)))
    return "mok cuda gemm: the fused dispatch needs the gate/up epilogue, its row map, counters and aligned x";
  if (get_encoder() == nullptr) return "mok cuda gemm: cuTensorMapEncodeTiled unavailable";

  CUtensorMap tm_a, tm_b0, tm_b1;
  if (!make_map_a(&tm_a, a.a, a.m_rows, a.k)) return "mok cuda gemm: tensor map (A) encode failed";
  if (!make_map_b(&tm_b0, a.b0, a.groups, a.k, a.n)) return "mok cuda gemm: tensor map (B0) encode failed";
  if (fused) {
    if (!make_map_b(&tm_b1, a.b1, a.groups, a.k, a.n)) return "mok cuda gemm: tensor map (B1) encode failed";
  } else {
    tm_b1 = tm_b0;
  }

  KParams p;
  p.m_rows = static_cast<int>(a.m_rows);
  p.n = static_cast<int>(a.n);
  p.k_blocks = static_cast<int>((a.k + kBK - 1) / kBK);
  const int64_t tile_n = fused ? 128 : 256;
  const int64_t n_tiles = (a.n + tile_n - 1) / tile_n;
  const int64_t m_tiles = (a.m_rows + kBM - 1) / kBM;
  if (n_tiles * m_tiles > (int64_t(1) << 31) - 1) return "mok cuda gemm: too many tiles";
  p.n_tiles = static_cast<int>(n_tiles);
  p.m_tiles = static_cast<int>(m_tiles);
  p.tile_group = a.tile_group;
  p.row_mask = a.row_mask;
  p.out0 = static_cast<__nv_bfloat16*>(a.out0);
  p.out1 = static_cast<__nv_bfloat16*>(a.out1);
  p.out2 = static_cast<__nv_bfloat16*>(a.out2);
  p.row_dst = a.row_dst;
  p.zero_unused = a.zero_unused_tiles ? 1 : 0;
  // The fused dispatch writes A, which the GEMM otherwise only reads.
  p.fd = fd;
  p.fd.vec = static_cast<int>(a.k / 8);
  p.fd.dst = static_cast<uint4*>(const_cast<void*>(a.a));

  // Output maps for the TMA-store epilogue: boxes of 64 columns x 16 rows (one
  // consumer warp's chunk). Not for per-row destinations (row_dst).
  CUtensorMap tm_out[3];
  bool tma_store = false;
#if MOK_GEMM_TMA_STORE
  tma_store = a.row_dst == nullptr && gemm_tma_store();
  p.tma_store = tma_store ? 1 : 0;
#endif
  if (tma_store) {
    // Gate/up not kept: their (unused) maps point at the activation.
    void* const act = fused ? a.out2 : a.out0;
    void* outs[3] = {keep_pre ? a.out0 : act, fused && keep_pre ? a.out1 : act, act};
    for (int j = 0; j < 3; ++j)
      if (!make_map_2d(&tm_out[j], outs[j], a.m_rows, a.n, 64, 16))
        return "mok cuda gemm: tensor map (output) encode failed";
  } else {
    tm_out[0] = tm_out[1] = tm_out[2] = tm_a;  // unused
  }

#if MOK_GEMM_TMA_STORE
  if (tma_store && gemm_pingpong(fused, keep_pre, p.k_blocks)) {
    CUtensorMap tm_a64;
    if (!make_map_2d(&tm_a64, a.a, a.m_rows, a.k, kBK, kBM / 2)) return "mok cuda gemm: tensor map (A) encode failed";
    const PingpongGemm g{&tm_a64,
                         &tm_b0,
                         &tm_b1,
                         {&tm_out[0], &tm_out[1], &tm_out[2]},
                         {p.m_rows, p.n, p.k_blocks, p.n_tiles, p.m_tiles, gemm_group_m(), p.tile_group, p.row_mask,
                          p.out0, p.out1, p.out2, p.zero_unused, p.fd},
                         fused,
                         keep_pre};
    return launch_grouped_gemm_pingpong(g, num_sms, stream);
  }
#endif
  const int cluster = gemm_cluster_size();
  p.group_m = std::max(1, gemm_group_m() / cluster);
  auto go = [&](auto fused_c, auto keep_c) {
    constexpr bool kF = decltype(fused_c)::value, kK = decltype(keep_c)::value;
    return cluster == 2 ? launch_kernel<kF, 2, kK>(tm_a, tm_b0, tm_b1, tm_out, p, num_sms, stream)
                        : launch_kernel<kF, 1, kK>(tm_a, tm_b0, tm_b1, tm_out, p, num_sms, stream);
  };
  using std::false_type, std::true_type;
  if (!fused) return go(false_type{}, true_type{});
  return keep_pre ? go(true_type{}, true_type{}) : go(true_type{}, false_type{});
}

}  // namespace mok::cuda
