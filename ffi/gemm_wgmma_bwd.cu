// Backward GEMMs (see gemm_wgmma.cuh, "backward"): the forward's wgmma machinery
// (TMA 128B-swizzle loads into a 4-stage mbarrier ring, 1 producer WG + 2
// consumer WGs with setmaxnreg 40/232, persistent grid, 128x256 CTA tile of two
// m64n256k16 accumulators) with three operand/epilogue variants:
//   kSwiGLU : dgrad, A K-major, B K-major [groups, n, k] (trans-b 0), SwiGLU-backward
//             epilogue (dg, du, w*a, per-tile partial dots of gd*a)
//   kSum2   : dgrad, K over [A0 | A1] x [B0 | B1] (both K-major), plain store
//   kWgrad  : A MN-major (trans-a 1), B MN-major (trans-b 1), K = the group's rows
//             (offsets read on the device), plain store into out[g]
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cuda_problem.h"
#include "cuda_ptx.cuh"
#include "gemm_tile.cuh"
#include "gemm_wgmma.cuh"
#include "swiglu_bwd_epilogue.cuh"

namespace mok::cuda {
namespace {

// The tile geometry and shared-memory layout are the forward's (gemm_tile.cuh).
using tile::kABytes;
using tile::kBK;
using tile::kBM;
using tile::kBN;
using tile::kConsumerWarps;
using tile::kStageBytes;
using tile::kStages;
using tile::kStgPitch;
constexpr int kKernelSmemBytes = tile::kStagedGemmSmemBytes;
using tile::kThreads;
using tile::pack_bf16x2;
constexpr int kChunk = tile::kBChunk;  // 8 KB: one MN-major 64 x 64 box

enum Mode : int { kSwiGLU = 0, kSum2 = 1, kWgrad = 2 };

struct Maps {
  // kSwiGLU: [0] A, [1] B.  kSum2: [0] A0, [1] B0, [2] A1, [3] B1.
  // kWgrad: job j: [2j] A, [2j+1] B.
  CUtensorMap m[6];
#if MOK_GEMM_TMA_STORE
  // TMA-store epilogue: kSum2 out[0]; kWgrad out[j] ([groups, m, n], job j);
  // kSwiGLU out[0..2] = dg, du, w*a (32-column boxes, 64-byte swizzle).
  CUtensorMap out[3];
#endif
};

struct JobP {
  int m, n, m_tiles, n_tiles, unit_begin;
  __nv_bfloat16* out;
};

struct BParams {
  // dgrad
  int m_rows, n, k_blocks, kb_half, n_tiles, m_tiles;
  const int32_t* tile_group;
  const __nv_bfloat16* gate_pre;
  const __nv_bfloat16* up_pre;
  const int32_t* row_pair;
  const float* pair_weight;
  const uint8_t* row_mask;
  __nv_bfloat16* out0;
  __nv_bfloat16* out1;
  __nv_bfloat16* out2;
  const uint64_t* row_dst;  // kSum2: per-row destinations, or nullptr
  float* part;
  // wgrad
  JobP job[3];
  int jobs;
  int rows;
  const int32_t* offsets;
  // both
  int units;
  int group_m;  // rasterisation band (tile::raster)
};

// One work unit, decoded identically by producer and consumers.
struct Unit {
  bool skip;
  int mt, nt, grp;    // grp: weight group (dgrad) or row group (wgrad)
  int kb_count;       // K blocks
  int row0;           // wgrad: first K row
  int m, n;           // output extent (rows, cols) of this unit's matrix
  int job;            // wgrad job
};

template <int kMode>
__device__ __forceinline__ Unit decode(const BParams& p, int u) {
  Unit x;
  x.job = 0;
  x.row0 = 0;
  if (kMode != kWgrad) {
    const tile::TileCoord c = tile::raster(u, p.m_tiles, p.n_tiles, p.group_m);
    x.mt = c.mt;
    x.nt = c.nt;
    x.grp = p.tile_group ? p.tile_group[x.mt] : 0;
    x.skip = x.grp < 0;
    x.kb_count = p.k_blocks;
    x.m = p.m_rows;
    x.n = p.n;
  } else {
    int j = 0;
#pragma unroll
    for (int i = 1; i < 3; ++i)
      if (i < p.jobs && u >= p.job[i].unit_begin) j = i;
    const JobP& jb = j == 0 ? p.job[0] : (j == 1 ? p.job[1] : p.job[2]);
    const int v = u - jb.unit_begin;
    const int per = jb.m_tiles * jb.n_tiles;
    const int g = v / per;
    const int r = v - g * per;
    x.job = j;
    x.grp = g;
    const tile::TileCoord c = tile::raster(r, jb.m_tiles, jb.n_tiles, p.group_m);
    x.mt = c.mt;
    x.nt = c.nt;
    const int r0 = p.offsets ? p.offsets[g] : 0;
    const int r1 = p.offsets ? p.offsets[g + 1] : p.rows;
    x.row0 = r0;
    x.kb_count = r1 > r0 ? (r1 - r0 + kBK - 1) / kBK : 0;
    x.m = jb.m;
    x.n = jb.n;
    x.skip = false;
  }
  return x;
}

// kTma (only in -DMOK_GEMM_TMA_STORE=1 builds): the epilogue stores through
// TMA. A template argument, not a runtime branch, so each kernel holds one
// epilogue and ptxas allocates its 168 registers for it alone (the first
// SwiGLU TMA epilogue, with run-time region indices, spilled 1.2 KB per
// thread beside the other one).
template <int kMode, bool kTma>
__global__ void __launch_bounds__(kThreads, 1) bwd_gemm_kernel(const __grid_constant__ Maps maps, const BParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty_bar = full_bar + kStages;
  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&empty_bar[s], kConsumerWarps);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int i = 0; i < (kMode == kSwiGLU ? 2 : (kMode == kSum2 ? 4 : 2 * p.jobs)); ++i)
        ptx::tma_prefetch_desc(&maps.m[i]);
      uint32_t it = 0;
      for (int u = blockIdx.x; u < p.units; u += gridDim.x) {
        const Unit x = decode<kMode>(p, u);
        if (x.skip) continue;
        for (int kb = 0; kb < x.kb_count; ++kb, ++it) {
          const uint32_t s = it % kStages;
          const uint32_t par = (it / kStages) & 1;
          ptx::mbar_wait(&empty_bar[s], par ^ 1);
          uint8_t* sa = smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          ptx::mbar_arrive_expect_tx(&full_bar[s], kStageBytes);
          if (kMode == kWgrad) {
            const CUtensorMap* ma = &maps.m[2 * x.job];
            const CUtensorMap* mb = &maps.m[2 * x.job + 1];
            const int r = x.row0 + kb * kBK;
            ptx::tma_load_2d(sa, ma, x.mt * kBM, r, &full_bar[s]);
            ptx::tma_load_2d(sa + kChunk, ma, x.mt * kBM + 64, r, &full_bar[s]);
#pragma unroll
            for (int j = 0; j < 4; ++j) ptx::tma_load_2d(sb + j * kChunk, mb, x.nt * kBN + j * 64, r, &full_bar[s]);
          } else {
            int kk = kb, h = 0;
            if (kMode == kSum2 && kb >= p.kb_half) {
              kk = kb - p.kb_half;
              h = 1;
            }
            ptx::tma_load_2d(sa, &maps.m[2 * h], kk * kBK, x.mt * kBM, &full_bar[s]);
            ptx::tma_load_3d(sb, &maps.m[2 * h + 1], kk * kBK, x.nt * kBN, x.grp, &full_bar[s]);
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
    constexpr bool tma = kTma;
    tile::TmaTileStore tts{stg, lane, 0, {false, false}, 0u};
#endif
    float acc[128];
    uint32_t it = 0;
    for (int u = blockIdx.x; u < p.units; u += gridDim.x) {
      const Unit x = decode<kMode>(p, u);
      if (x.skip) continue;
      // Which of this thread's two rows are live, and their routing weights: read
      // before the main loop so the dependent row_pair -> pair_weight loads overlap it.
      const int wrow0 = x.mt * kBM + cw * 64 + warp * 16;
      const int row0 = wrow0 + (lane >> 2);
      bool keep[2];
      float wrow[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + h * 8;
        keep[h] = row < x.m;
        wrow[h] = 1.0f;
        if (kMode == kSwiGLU) {
          if (p.row_pair != nullptr) {
            const int pr = keep[h] ? p.row_pair[row] : -1;
            keep[h] = pr >= 0;
            wrow[h] = keep[h] ? p.pair_weight[pr] : 0.0f;
          } else if (p.row_mask != nullptr && keep[h]) {
            keep[h] = p.row_mask[row] != 0;
          }
        }
      }
      if (x.kb_count == 0) {
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      }
      uint32_t prev_s = 0;
      for (int kb = 0; kb < x.kb_count; ++kb, ++it) {
        const uint32_t s = it % kStages;
        const uint32_t par = (it / kStages) & 1;
        ptx::mbar_wait(&full_bar[s], par);
        const uint32_t sa = ptx::smem_u32(smem + s * kStageBytes);
        const uint32_t sb = sa + kABytes;
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          if (kMode == kWgrad) {
            const uint64_t da = ptx::make_smem_desc_sw128(sa + cw * kChunk + kk * 2048, kChunk, 1024);
            const uint64_t db = ptx::make_smem_desc_sw128(sb + kk * 2048, kChunk, 1024);
            ptx::wgmma_m64n256k16_bf16<1, 1>(acc, da, db, (kb | kk) != 0);
          } else {
            const uint64_t da = ptx::make_smem_desc_sw128(sa + cw * (64 * 128) + kk * 32, 16, 1024);
            const uint64_t db = ptx::make_smem_desc_sw128(sb + kk * 32, 16, 1024);
            ptx::wgmma_m64n256k16_bf16<0, 0>(acc, da, db, (kb | kk) != 0);
          }
        }
        ptx::wgmma_commit();
        if (kb > 0) {
          ptx::wgmma_wait<1>();
          if (lane == 0) ptx::mbar_arrive(&empty_bar[prev_s]);
        }
        prev_s = s;
      }
      ptx::wgmma_wait<0>();
      if (x.kb_count > 0 && lane == 0) ptx::mbar_arrive(&empty_bar[prev_s]);
#pragma unroll
      for (int i = 0; i < 128; ++i) ptx::fence_operand(acc[i]);

      // ---------------------------------------------------------- epilogue
      const int colq = (lane & 3) * 2;
      const int n_base = x.nt * kBN;
      __nv_bfloat16* out0 = p.out0;
      if (kMode == kWgrad) {
        const JobP& jb = x.job == 0 ? p.job[0] : (x.job == 1 ? p.job[1] : p.job[2]);
        out0 = jb.out + static_cast<size_t>(x.grp) * x.m * x.n;
      }
      auto put = [&](int gg, int h, uint32_t v) {
        *reinterpret_cast<uint32_t*>(stg + ((lane >> 2) + h * 8) * kStgPitch + gg * 16 + (lane & 3) * 4) = v;
      };
      auto flush = [&](__nv_bfloat16* out, int col0) {
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int idx = lane + 32 * i;
          const int r = idx >> 3, c = idx & 7;
          const int row = wrow0 + r, col = col0 + c * 8;
          const uint4 v = *reinterpret_cast<const uint4*>(stg + r * kStgPitch + c * 16);
          if (row < x.m && col < x.n) {
            __nv_bfloat16* dst = out + static_cast<size_t>(row) * x.n;
            if (kMode == kSum2 && p.row_dst != nullptr) dst = reinterpret_cast<__nv_bfloat16*>(p.row_dst[row]);
            if (dst != nullptr && MOK_GEMM_EPILOGUE_PROBE == 0) *reinterpret_cast<uint4*>(dst + col) = v;
          }
        }
        __syncwarp();
      };
      if (kMode == kSwiGLU) {
        float dot[2] = {0.f, 0.f};
#if MOK_GEMM_TMA_STORE
        if (tma) {
          swiglu_bwd::epilogue_tma(acc, stg, lane, wrow0, x.m, x.n, n_base, keep, wrow, p.gate_pre,
                                   p.up_pre, &maps.out[0], &maps.out[1], &maps.out[2], dot);
        } else
#endif
        {
        // 8 chunks of 32 columns. The warp's 16 x 32 gate and up values of a chunk
        // arrive through the staging buffer: coalesced 16-byte loads (gate -> staging
        // cols [0, 32), up -> [32, 64), the flush pattern), issued one chunk ahead
        // so their latency hides behind the previous chunk's math; each thread then
        // reads its fragment's values where it later puts dg and du (same thread,
        // same address: no barrier between). dg and du are flushed together; then
        // w*a -> [0, 32). (Fragment-order 4-byte loads straight from global were
        // half-sector, latency-exposed and made this epilogue the backward's slowest
        // stage: ncu showed 51 % of the warp cycles in L1TEX scoreboard stalls.)
        uint4 gu[4];
        auto load_gu = [&](int ch) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int idx = lane + 32 * i;
            const int r = idx >> 3, c = idx & 7;
            const int row = wrow0 + r, col = n_base + ch * 32 + (c & 3) * 8;
            gu[i] = make_uint4(0u, 0u, 0u, 0u);
            if (row < x.m && col < x.n)
              gu[i] = __ldg(reinterpret_cast<const uint4*>((c < 4 ? p.gate_pre : p.up_pre) +
                                                           static_cast<size_t>(row) * x.n + col));
          }
        };
        auto get = [&](int gg, int h) {
          return *reinterpret_cast<const __nv_bfloat162*>(stg + ((lane >> 2) + h * 8) * kStgPitch + gg * 16 +
                                                          (lane & 3) * 4);
        };
        load_gu(0);
#pragma unroll
        for (int ch = 0; ch < 8; ++ch) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int idx = lane + 32 * i;
            *reinterpret_cast<uint4*>(stg + (idx >> 3) * kStgPitch + (idx & 7) * 16) = gu[i];
          }
          __syncwarp();
          if (ch + 1 < 8) load_gu(ch + 1);
          uint32_t pa[4][2];
#pragma unroll
          for (int gg = 0; gg < 4; ++gg) {
            const int col = n_base + ch * 32 + gg * 8 + colq;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = (ch * 4 + gg) * 4 + h * 2;
              const bool live = keep[h] && col < x.n;
              float dg[2], du[2], aw[2];
              swiglu_bwd::pair(__bfloat1622float2(get(gg, h)), __bfloat1622float2(get(4 + gg, h)), &acc[i],
                               wrow[h], live, dot[h], dg, du, aw);
              put(gg, h, live ? pack_bf16x2(dg[0], dg[1]) : 0u);
              put(4 + gg, h, live ? pack_bf16x2(du[0], du[1]) : 0u);
              pa[gg][h] = live ? pack_bf16x2(aw[0], aw[1]) : 0u;
            }
          }
          const int col0 = n_base + ch * 32;
          __syncwarp();
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int idx = lane + 32 * i;
            const int r = idx >> 3, c = idx & 7;
            const int row = wrow0 + r, col = col0 + (c & 3) * 8;
            const uint4 v = *reinterpret_cast<const uint4*>(stg + r * kStgPitch + c * 16);
            if (row < x.m && col < x.n && MOK_GEMM_EPILOGUE_PROBE == 0)
              *reinterpret_cast<uint4*>((c < 4 ? p.out0 : p.out1) + static_cast<size_t>(row) * x.n + col) = v;
          }
          __syncwarp();
#pragma unroll
          for (int gg = 0; gg < 4; ++gg)
#pragma unroll
            for (int h = 0; h < 2; ++h) put(gg, h, pa[gg][h]);
          __syncwarp();
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int idx = lane + 32 * i;
            const int r = idx >> 2, c = idx & 3;
            const int row = wrow0 + r, col = col0 + c * 8;
            const uint4 v = *reinterpret_cast<const uint4*>(stg + r * kStgPitch + c * 16);
            if (row < x.m && col < x.n && MOK_GEMM_EPILOGUE_PROBE == 0)
              *reinterpret_cast<uint4*>(p.out2 + static_cast<size_t>(row) * x.n + col) = v;
          }
          __syncwarp();
        }
        }
        // Quad reduction (fixed shuffle order): lanes 4q..4q+3 hold one row.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float d = dot[h];
          d += __shfl_xor_sync(0xffffffffu, d, 1);
          d += __shfl_xor_sync(0xffffffffu, d, 2);
          const int row = row0 + h * 8;
          if (p.part != nullptr && (lane & 3) == 0 && row < x.m)
            p.part[static_cast<size_t>(row) * p.n_tiles + x.nt] = keep[h] ? d : 0.0f;
        }
#if MOK_GEMM_TMA_STORE
      } else if (tma) {
        tts.wrow0 = wrow0;
        tts.keep[0] = keep[0], tts.keep[1] = keep[1];
        tts.z = kMode == kWgrad ? x.grp : -1;  // wgrad: out[job] is the stack [groups, m, n]
        tile::store_plain(acc, tts, n_base, &maps.out[kMode == kWgrad ? x.job : 0]);
#endif
      } else {
#pragma unroll
        for (int ch = 0; ch < 4; ++ch) {
#pragma unroll
          for (int gg = 0; gg < 8; ++gg)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = (ch * 8 + gg) * 4 + h * 2;
              put(gg, h, keep[h] ? pack_bf16x2(acc[i], acc[i + 1]) : 0u);
            }
          flush(out0, n_base + ch * 64);
        }
      }
    }
#if MOK_GEMM_TMA_STORE
    if (tma) tts.drain();  // every TMA store complete before the CTA exits
#endif
  }
}

// ------------------------------------------------------------------ host side
// The driver entry point is fetched once, in gemm_wgmma.cu.
PFN_cuTensorMapEncodeTiled_v12000 encoder() { return get_encoder(); }

// 3-D [groups, n, k] bf16 (K-major B), box {64 k, 256 n, 1}.
bool map_bk(CUtensorMap* m, const void* ptr, int64_t groups, int64_t n, int64_t k) {
  return make_map_3d_rows(m, ptr, groups, n, k, kBK, kBN);
}

constexpr int64_t kMaxInt = (int64_t(1) << 31) - 1024;

template <int kMode, bool kTma>
const char* launch_as(const Maps& maps, BParams p, int num_sms, cudaStream_t stream) {
  auto* kern = bwd_gemm_kernel<kMode, kTma>;
  static std::atomic<int> attr_done{0};
  if (attr_done.load() == 0) {
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kKernelSmemBytes) != cudaSuccess)
      return "mok cuda bwd gemm: cudaFuncSetAttribute failed";
    attr_done.store(1);
  }
  if (p.units <= 0) return nullptr;
  p.group_m = gemm_group_m();
  const int grid = std::max(1, std::min(p.units, num_sms));
  bwd_gemm_kernel<kMode, kTma><<<grid, kThreads, kKernelSmemBytes, stream>>>(maps, p);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda bwd gemm: kernel launch failed";
  return nullptr;
}

// tma: the TMA-store kernel (maps.out filled; -DMOK_GEMM_TMA_STORE=1 builds only).
template <int kMode>
const char* launch(const Maps& maps, const BParams& p, bool tma, int num_sms, cudaStream_t stream) {
#if MOK_GEMM_TMA_STORE
  if (tma) return launch_as<kMode, true>(maps, p, num_sms, stream);
#endif
  (void)tma;
  return launch_as<kMode, false>(maps, p, num_sms, stream);
}

// In a -DMOK_GEMM_TMA_STORE=1 build (gemm_tma_store() on): which backward
// epilogues store through TMA, bits 1 = the d_x dgrad (kSum2), 2 = the weight
// gradients, 4 = the SwiGLU-backward dgrad; all unless MOK_CUDA_BWD_TMA_STORE
// names a subset (to tell the three apart in an A/B).
[[maybe_unused]] bool bwd_tma_store(int mode) {
  static const int mask = [] {
    const char* e = std::getenv("MOK_CUDA_BWD_TMA_STORE");
    return e != nullptr ? std::atoi(e) & 7 : 7;
  }();
  const int bit = mode == kSum2 ? 1 : (mode == kWgrad ? 2 : 4);
  return gemm_tma_store() != 0 && (mask & bit) != 0;
}

const char* dgrad_common(const DgradArgs& a, bool sum2, Maps& maps, BParams& p) {
  if (a.m_rows <= 0) return "empty";
  if (a.k <= 0 || a.n <= 0 || a.k % 8 != 0 || a.n % 8 != 0) return "mok cuda bwd gemm: k and n must be positive multiples of 8";
  if (a.m_rows > kMaxInt || a.k > kMaxInt || a.n > kMaxInt || a.groups > kMaxInt || a.groups <= 0)
    return "mok cuda bwd gemm: dimension too large";
  if (a.row_dst != nullptr && !sum2) return "mok cuda bwd gemm: row_dst is for the sum2 dgrad only";
  if (!aligned16(a.a0) || !aligned16(a.b0) || (a.row_dst == nullptr && !aligned16(a.out0)) ||
      (sum2 && (!aligned16(a.a1) || !aligned16(a.b1))))
    return "mok cuda bwd gemm: pointers must be 16-byte aligned";
  if (encoder() == nullptr) return "mok cuda bwd gemm: cuTensorMapEncodeTiled unavailable";
  std::memset(&maps, 0, sizeof(maps));
  if (!make_map_2d(&maps.m[0], a.a0, a.m_rows, a.k, kBK, kBM) || !map_bk(&maps.m[1], a.b0, a.groups, a.n, a.k))
    return "mok cuda bwd gemm: tensor map encode failed";
  if (sum2 && (!make_map_2d(&maps.m[2], a.a1, a.m_rows, a.k, kBK, kBM) || !map_bk(&maps.m[3], a.b1, a.groups, a.n, a.k)))
    return "mok cuda bwd gemm: tensor map encode failed";
  std::memset(&p, 0, sizeof(p));
  const int64_t kb = (a.k + kBK - 1) / kBK;
  const int64_t n_tiles = (a.n + kBN - 1) / kBN;
  const int64_t m_tiles = (a.m_rows + kBM - 1) / kBM;
  if (n_tiles * m_tiles > kMaxInt) return "mok cuda bwd gemm: too many tiles";
  p.m_rows = static_cast<int>(a.m_rows);
  p.n = static_cast<int>(a.n);
  p.kb_half = static_cast<int>(kb);
  p.k_blocks = static_cast<int>(sum2 ? 2 * kb : kb);
  p.n_tiles = static_cast<int>(n_tiles);
  p.m_tiles = static_cast<int>(m_tiles);
  p.tile_group = a.tile_group;
  p.units = static_cast<int>(n_tiles * m_tiles);
  p.out0 = static_cast<__nv_bfloat16*>(a.out0);
  return nullptr;
}

}  // namespace

const char* launch_dgrad_swiglu_bwd(const DgradArgs& a, int num_sms, cudaStream_t stream) {
  Maps maps;
  BParams p;
  if (const char* e = dgrad_common(a, false, maps, p)) return e[0] == 'e' ? nullptr : e;
  if (!aligned16(a.out1) || !aligned16(a.out2) || a.gate_pre == nullptr || a.up_pre == nullptr ||
      (a.row_pair != nullptr && a.pair_weight == nullptr))
    return "mok cuda bwd gemm: bad SwiGLU-backward arguments";
  p.gate_pre = static_cast<const __nv_bfloat16*>(a.gate_pre);
  p.up_pre = static_cast<const __nv_bfloat16*>(a.up_pre);
  p.row_pair = a.row_pair;
  p.pair_weight = a.pair_weight;
  p.row_mask = a.row_mask;
  p.out1 = static_cast<__nv_bfloat16*>(a.out1);
  p.out2 = static_cast<__nv_bfloat16*>(a.out2);
  p.part = a.part;
  bool tma = false;
#if MOK_GEMM_TMA_STORE
  tma = bwd_tma_store(kSwiGLU);
  if (tma) {
    void* outs[3] = {a.out0, a.out1, a.out2};
    for (int j = 0; j < 3; ++j)
      if (!make_map_2d(&maps.out[j], outs[j], a.m_rows, a.n, 32, 16, CU_TENSOR_MAP_SWIZZLE_64B))
        return "mok cuda bwd gemm: tensor map (output) encode failed";
  }
#endif
  return launch<kSwiGLU>(maps, p, tma, num_sms, stream);
}

const char* launch_dgrad_sum2(const DgradArgs& a, int num_sms, cudaStream_t stream) {
  Maps maps;
  BParams p;
  if (const char* e = dgrad_common(a, true, maps, p)) return e[0] == 'e' ? nullptr : e;
  p.row_dst = a.row_dst;
  // TMA-store epilogue (-DMOK_GEMM_TMA_STORE=1 builds): boxes of 64 columns x 16 rows of out0.
  bool tma = false;
#if MOK_GEMM_TMA_STORE
  tma = a.row_dst == nullptr && bwd_tma_store(kSum2);
  if (tma && !make_map_2d(&maps.out[0], a.out0, a.m_rows, a.n, 64, 16))
    return "mok cuda bwd gemm: tensor map (output) encode failed";
#endif
  return launch<kSum2>(maps, p, tma, num_sms, stream);
}

const char* launch_wgrad(const WgradArgs& a, int num_sms, cudaStream_t stream) {
  if (a.jobs < 1 || a.jobs > 3) return "mok cuda wgrad: 1..3 jobs";
  if (a.rows <= 0) return "mok cuda wgrad: no rows";
  if (a.rows > kMaxInt || a.groups <= 0 || a.groups > kMaxInt) return "mok cuda wgrad: dimension too large";
  if (encoder() == nullptr) return "mok cuda wgrad: cuTensorMapEncodeTiled unavailable";
  Maps maps;
  BParams p;
  std::memset(&maps, 0, sizeof(maps));
  std::memset(&p, 0, sizeof(p));
  int64_t units = 0;
  bool tma = false;
#if MOK_GEMM_TMA_STORE
  tma = bwd_tma_store(kWgrad);
#endif
  for (int j = 0; j < a.jobs; ++j) {
    const WgradJob& jb = a.job[j];
    if (jb.m <= 0 || jb.n <= 0 || jb.m % 8 != 0 || jb.n % 8 != 0 || jb.m > kMaxInt || jb.n > kMaxInt)
      return "mok cuda wgrad: m and n must be positive multiples of 8";
    if (!aligned16(jb.a) || !aligned16(jb.b) || !aligned16(jb.out)) return "mok cuda wgrad: pointers must be 16-byte aligned";
    if (!make_map_2d(&maps.m[2 * j], jb.a, a.rows, jb.m, 64, 64) || !make_map_2d(&maps.m[2 * j + 1], jb.b, a.rows, jb.n, 64, 64))
      return "mok cuda wgrad: tensor map encode failed";
    JobP& q = p.job[j];
    q.m = static_cast<int>(jb.m);
    q.n = static_cast<int>(jb.n);
    q.m_tiles = static_cast<int>((jb.m + kBM - 1) / kBM);
    q.n_tiles = static_cast<int>((jb.n + kBN - 1) / kBN);
    q.unit_begin = static_cast<int>(units);
    q.out = static_cast<__nv_bfloat16*>(jb.out);
    units += a.groups * q.m_tiles * q.n_tiles;
    if (units > kMaxInt) return "mok cuda wgrad: too many tiles";
#if MOK_GEMM_TMA_STORE
    // TMA-store epilogue: boxes of 64 columns x 16 rows of out[g], clipped at
    // each matrix's last row.
    if (tma && !make_map_3d_rows(&maps.out[j], jb.out, a.groups, jb.m, jb.n, 64, 16))
      return "mok cuda wgrad: tensor map (output) encode failed";
#endif
  }
  p.jobs = a.jobs;
  p.rows = static_cast<int>(a.rows);
  p.offsets = a.offsets;
  p.units = static_cast<int>(units);
  return launch<kWgrad>(maps, p, tma, num_sms, stream);
}

}  // namespace mok::cuda
