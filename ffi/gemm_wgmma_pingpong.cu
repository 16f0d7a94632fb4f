// The forward's grouped GEMMs (gate/up with the fused SwiGLU, and down) on
// ping-pong consumers, as the backward's SwiGLU kernel (gemm_wgmma_bwd_pingpong.cu,
// where the scheme is described): a 2-CTA cluster computes each 128 x 256 unit,
// CTA r its rows [64 r, 64 r + 64) on one consumer warpgroup, units
// alternating between the two warpgroups, so one warpgroup's epilogue runs
// under the other's main loop. Both CTAs of a unit share its weight group, so
// each loads its 64 rows of A and half of the B stage, multicast to both: 24 KB
// from L2 per 2.1 MFLOP, against 16 KB for the cooperative kernel with
// clusters (why it is the default only where the epilogue is heavy and K
// short: gemm_pingpong in gemm_wgmma.cuh). Each warpgroup has its own full
// barriers (see gemm_wgmma_bwd_pingpong.cu). Each warpgroup computes
// exactly what the cooperative kernel's warpgroup r computes for those rows:
// bitwise the same outputs. TMA-store epilogues only, no per-row destinations
// (launch_grouped_gemm falls back to the cooperative kernel otherwise).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdlib>

#include "cuda_ptx.cuh"
#include "dispatch_fused.cuh"
#include "gemm_tile.cuh"
#include "gemm_wgmma.cuh"
#include "pingpong_ring.cuh"

namespace mok::cuda {

bool gemm_pingpong(bool fused, bool keep_pre, int k_blocks) {
  static const int mode = [] {  // -1: by the measured rule (gemm_wgmma.cuh)
    const char* e = std::getenv("MOK_CUDA_GEMM_PINGPONG");
    return e == nullptr ? -1 : (std::atoi(e) != 0 ? 1 : 0);
  }();
  return mode < 0 ? fused && keep_pre && k_blocks <= kPingpongMaxKBlocks : mode == 1;
}

#if MOK_GEMM_TMA_STORE
namespace {

using tile::kABytes;
using tile::kBChunk;
using tile::kBK;
using tile::kBM;
using tile::kStageBytes;
using tile::kStages;
using tile::kThreads;
constexpr int kSmemBytes = tile::kStagedGemmSmemBytes;
using pingpong::kHalfRows;
constexpr uint32_t kStageTx = kHalfRows * kBK * 2 + tile::kBBytes;  // 8 KB A + 32 KB B per CTA

template <bool kFused, bool kKeepPre>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_pingpong_kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b0,
                                 const __grid_constant__ CUtensorMap tm_b1, const __grid_constant__ CUtensorMap tm_out0,
                                 const __grid_constant__ CUtensorMap tm_out1,
                                 const __grid_constant__ CUtensorMap tm_out2, const PingpongParams p) {
  extern __shared__ uint8_t smem_raw[];
  const pingpong::Ring ring = pingpong::setup_ring(smem_raw);
  uint8_t* smem = ring.smem;
  uint64_t* full_bar = ring.full_bar;
  uint64_t* empty_bar = ring.empty_bar;
  const int wg = threadIdx.x / 128;
  const uint32_t crank = ptx::cluster_ctarank();
  const int cid = blockIdx.x / 2;
  const int ncl = gridDim.x / 2;
  const int num_units = p.m_tiles * p.n_tiles;
  auto group_of = [&](int mt) -> int { return p.tile_group ? p.tile_group[mt] : 0; };

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (kFused && p.fd.x != nullptr && threadIdx.x >= 32) {
      fused_dispatch::copy_role(p.fd, threadIdx.x & 31);  // warps 1-3: the fused dispatch
    } else if (threadIdx.x == 0) {
      ptx::tma_prefetch_desc(&tm_a);
      ptx::tma_prefetch_desc(&tm_b0);
      if (kFused) ptx::tma_prefetch_desc(&tm_b1);
      uint32_t it = 0, live = 0;
      for (int u = cid; u < num_units; u += ncl) {
        const tile::TileCoord c = tile::raster(u, p.m_tiles, p.n_tiles, p.group_m);
        const int grp = group_of(c.mt);
        if (grp < 0) continue;  // the same decision in both CTAs: they stay in lock-step
        uint64_t* full = full_bar + (live++ & 1) * kStages;  // the owning warpgroup's barriers
        if (kFused && p.fd.x != nullptr) fused_dispatch::wait_tile(p.fd, c.mt);  // rows this kernel copies
        for (int kb = 0; kb < p.k_blocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          const uint32_t par = (it / kStages) & 1;
          ptx::mbar_wait(&empty_bar[s], par ^ 1);  // both CTAs' warpgroup released it
          uint8_t* sa = smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          ptx::mbar_arrive_expect_tx(&full[s], kStageTx);
          ptx::tma_load_2d(sa, &tm_a, kb * kBK, c.mt * kBM + static_cast<int>(crank) * kHalfRows, &full[s]);
          // B chunks 2 crank and 2 crank + 1 (8 KB each: 64 N x 64 K), to both CTAs.
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * static_cast<int>(crank) + jj;
            const CUtensorMap* map = (kFused && j >= 2) ? &tm_b1 : &tm_b0;
            const int ncol = kFused ? c.nt * 128 + (j & 1) * 64 : c.nt * 256 + j * 64;
            ptx::tma_load_3d_multicast(sb + j * kBChunk, map, ncol, kb * kBK, grp, &full[s], 0x3);
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
    tile::TmaTileStore tts{stg, lane, 0, {false, false}, 0u};
    const uint32_t peer_empty = ptx::map_to_rank(ptx::smem_u32(empty_bar), crank ^ 1);
    auto release = [&](uint32_t s) { pingpong::release_stage(empty_bar, peer_empty, s, lane); };
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    uint32_t live = 0;       // live units so far, both warpgroups'
    uint32_t it = 0;         // the ring position where the next live unit starts
    uint32_t phase_bits = 0; // this warpgroup's full-barrier parity per stage
    uint64_t* my_full = full_bar + cw * kStages;
    for (int u = cid; u < num_units; u += ncl) {
      const tile::TileCoord c = tile::raster(u, p.m_tiles, p.n_tiles, p.group_m);
      const int wrow0 = c.mt * kBM + static_cast<int>(crank) * kHalfRows + warp * 16;  // first row of this warp
      const int row0 = wrow0 + (lane >> 2);
      if (group_of(c.mt) < 0) {  // no loads, no math; zeros from warpgroup 0 when asked
        if (p.zero_unused && cw == 0)
          tile::zero_warp_rows<kFused, kKeepPre>(row0, lane, c.nt * (kFused ? 128 : 256), p.m_rows, p.n, p.out0,
                                                  p.out1, p.out2);
        continue;
      }
      const uint32_t nlive = live++;
      if (static_cast<int>(nlive & 1) != cw) {
        it += static_cast<uint32_t>(p.k_blocks);  // the other warpgroup's stage uses
        continue;
      }
      // A sits at the stage's start (this CTA's 64 rows): cw = 0 for the k loop.
      tile::mma_k_loop(acc, smem, my_full, it, p.k_blocks, 0, release, nullptr, false, tile::OwnedParity{phase_bits});
      tts.wrow0 = wrow0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + h * 8;
        tts.keep[h] = row < p.m_rows && (p.row_mask == nullptr || p.row_mask[row] != 0);
      }
      if (kFused) {
        tile::store_gate_up<kKeepPre>(acc, tts, c.nt * 128, &tm_out0, &tm_out1, &tm_out2);
      } else {
        tile::store_plain(acc, tts, c.nt * 256, &tm_out0);
      }
    }
    tts.drain();  // every TMA store complete before the CTA exits
  }
  // No CTA may exit while its partner can still multicast into its shared
  // memory or arrive on its barriers.
  __syncwarp();
  ptx::cluster_sync();
}

template <bool kFused, bool kKeepPre>
const char* launch_as(const PingpongGemm& g, int num_sms, cudaStream_t stream) {
  static std::atomic<int> resident{-1};
  return pingpong::launch_clusters(grouped_gemm_pingpong_kernel<kFused, kKeepPre>, resident, kSmemBytes,
                                   int64_t(g.p.m_tiles) * g.p.n_tiles, num_sms, stream,
                                   "mok cuda gemm (ping-pong): kernel launch failed", *g.a64, *g.b0, *g.b1, *g.out[0],
                                   *g.out[1], *g.out[2], g.p);
}

}  // namespace

const char* launch_grouped_gemm_pingpong(const PingpongGemm& g, int num_sms, cudaStream_t stream) {
  if (!g.fused) return launch_as<false, true>(g, num_sms, stream);
  return g.keep_pre ? launch_as<true, true>(g, num_sms, stream) : launch_as<true, false>(g, num_sms, stream);
}
#endif  // MOK_GEMM_TMA_STORE

}  // namespace mok::cuda
