// The down projection's dgrad with the SwiGLU-backward epilogue (mode kSwiGLU
// of bwd_tile.cuh) on ping-pong consumers: each consumer warpgroup owns whole
// units in turn, so one runs its epilogue (the backward's heaviest: it reads
// g, u and writes dg, du, w*a) while the other runs its main loop. In the
// cooperative kernel (gemm_wgmma_bwd.cu) both warpgroups share a tile and the
// tensor cores idle through every epilogue (ncu: tensor pipe 42 % active).
//
// Work split. A unit is the cooperative kernel's 128 x 256 tile; a 2-CTA
// cluster computes it, CTA r rows [64 r, 64 r + 64) on one of its consumer
// warpgroups, the cluster's units alternating between warpgroup 0 and 1. So
// each warpgroup computes exactly what warpgroup r of the cooperative kernel
// computes for the same rows (same stage image, same wgmma sequence, same
// epilogue code): the results are bitwise those of the cooperative kernel and
// of the backward megakernel. Both halves of a unit share the weight group
// (tile_group is per 128 rows), so each CTA loads its 64 rows of A and half of
// the B stage, multicast to both: L2 reads stay at the cooperative kernel's
// 24 KB per CTA and 2.1 MFLOP.
//
// The ring: the producer fills the stages in unit order, each stage use owned
// by the unit's warpgroup, and signals that warpgroup's own full barrier
// (kStages per warpgroup). One shared full barrier would alias: warpgroup 1
// starting unit 1 at ring position k_blocks waits for a phase the barrier
// reaches only after k_blocks / kStages completions, and a parity wait on a
// barrier two phases behind passes at once. On its own barriers a warpgroup
// waits for every phase in order (a parity bit per stage: tile::OwnedParity),
// and the producer cannot refill a stage before its owner released it. Each
// stage use is released by one warpgroup of each CTA: the empty barrier
// counts 2 x 4 warps and completes in ring order.
//
// TMA-store epilogue only (-DMOK_GEMM_TMA_STORE=1 builds, the default, with the
// SwiGLU TMA store selected): the register-store epilogue would spill here.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "bwd_tile.cuh"
#include "gemm_wgmma.cuh"
#include "pingpong_ring.cuh"

namespace mok::cuda {

bool bwd_swiglu_pingpong() {
  static const bool on = [] {
    const char* e = std::getenv("MOK_CUDA_BWD_PINGPONG");
    return e == nullptr || std::atoi(e) != 0;
  }();
  return on;
}

#if MOK_GEMM_TMA_STORE
namespace {

using namespace bwd;
constexpr int kSmemBytes = tile::kStagedGemmSmemBytes;
using tile::kThreads;
using pingpong::kHalfRows;
constexpr int kBHalfBytes = tile::kBBytes / 2;                      // 128 n rows x 64 k
constexpr uint32_t kStageTx = kHalfRows * kBK * 2 + tile::kBBytes;  // 8 KB A + 32 KB B per CTA

struct PPMaps {
  CUtensorMap a;       // [rows, k], box {64 k, 64 rows}
  CUtensorMap b_half;  // [groups, n, k], box {64 k, 128 n}
  CUtensorMap out[3];  // dg, du, w*a (as Maps::out)
};

__global__ void __launch_bounds__(kThreads, 1) bwd_swiglu_pingpong_kernel(const __grid_constant__ PPMaps maps,
                                                                          const BParams p) {
  extern __shared__ uint8_t smem_raw[];
  const pingpong::Ring ring = pingpong::setup_ring(smem_raw);
  uint8_t* smem = ring.smem;
  uint64_t* full_bar = ring.full_bar;
  uint64_t* empty_bar = ring.empty_bar;
  const int wg = threadIdx.x / 128;
  const uint32_t crank = ptx::cluster_ctarank();
  const int cid = blockIdx.x / 2;
  const int ncl = gridDim.x / 2;

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      ptx::tma_prefetch_desc(&maps.a);
      ptx::tma_prefetch_desc(&maps.b_half);
      uint32_t it = 0, live = 0;
      for (int u = cid; u < p.units; u += ncl) {
        const Unit x = decode<kSwiGLU>(p, u);
        if (x.skip) continue;  // the same decision in both CTAs: they stay in lock-step
        uint64_t* full = full_bar + (live++ & 1) * kStages;  // the owning warpgroup's barriers
        for (int kb = 0; kb < x.kb_count; ++kb, ++it) {
          const uint32_t s = it % kStages;
          const uint32_t par = (it / kStages) & 1;
          ptx::mbar_wait(&empty_bar[s], par ^ 1);  // both CTAs' warpgroup released it
          uint8_t* sa = smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          ptx::mbar_arrive_expect_tx(&full[s], kStageTx);
          ptx::tma_load_2d(sa, &maps.a, kb * kBK, x.mt * kBM + static_cast<int>(crank) * kHalfRows, &full[s]);
          ptx::tma_load_3d_multicast(sb + crank * kBHalfBytes, &maps.b_half, kb * kBK,
                                     x.nt * kBN + static_cast<int>(crank) * (kBN / 2), x.grp, &full[s], 0x3);
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
    TmaStore tts{stg, lane, 0, {false, false}, 0u};
    const uint32_t peer_empty = ptx::map_to_rank(ptx::smem_u32(empty_bar), crank ^ 1);
    float acc[128];
    uint32_t live = 0;        // live units so far, both warpgroups'
    uint32_t it = 0;          // the ring position where the next live unit starts
    uint32_t phase_bits = 0;  // this warpgroup's full-barrier parity per stage
    uint64_t* my_full = full_bar + cw * kStages;
    for (int u = cid; u < p.units; u += ncl) {
      const Unit x = decode<kSwiGLU>(p, u);
      if (x.skip) continue;
      const uint32_t n = live++;
      if (static_cast<int>(n & 1) != cw) {
        it += static_cast<uint32_t>(x.kb_count);  // the other warpgroup's stage uses
        continue;
      }
      const int wrow0 = x.mt * kBM + static_cast<int>(crank) * kHalfRows + warp * 16;
      bool keep[2];
      float wrow[2];
      unit_rows<kSwiGLU>(p, x, wrow0, lane, keep, wrow);
      // The stage's A holds only this CTA's 64 rows: cw = 0 for the k loop.
      unit_k_loop<kSwiGLU>(
          acc, smem, my_full, it, x, 0, [&](uint32_t s) { pingpong::release_stage(empty_bar, peer_empty, s, lane); },
          tile::OwnedParity{phase_bits});
      unit_epilogue<kSwiGLU, true>(maps, p, x, acc, wrow0, stg, lane, keep, wrow, tts);
    }
    tts.drain();  // every TMA store complete before the CTA exits
  }
  // No CTA may exit while its partner can still multicast into its shared
  // memory or arrive on its barriers.
  __syncwarp();
  ptx::cluster_sync();
}

const char* launch_as(const PPMaps& maps, const BParams& p, int num_sms, cudaStream_t stream) {
  static std::atomic<int> resident{-1};
  return pingpong::launch_clusters(bwd_swiglu_pingpong_kernel, resident, kSmemBytes, p.units, num_sms, stream,
                                   "mok cuda bwd gemm (ping-pong): kernel launch failed", maps, p);
}

}  // namespace

namespace bwd {

const char* launch_swiglu_pingpong(const DgradArgs& a, const Maps& maps, const BParams& p, int num_sms,
                                   cudaStream_t stream) {
  PPMaps pp;
  std::memset(&pp, 0, sizeof(pp));
  if (!make_map_2d(&pp.a, a.a0, a.m_rows, a.k, kBK, kHalfRows) ||
      !make_map_3d_rows(&pp.b_half, a.b0, a.groups, a.n, a.k, kBK, kBN / 2))
    return "mok cuda bwd gemm (ping-pong): tensor map encode failed";
  std::memcpy(pp.out, maps.out, sizeof(pp.out));
  return launch_as(pp, p, num_sms, stream);
}

}  // namespace bwd
#endif  // MOK_GEMM_TMA_STORE

}  // namespace mok::cuda
