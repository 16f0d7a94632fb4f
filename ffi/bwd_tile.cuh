// One 128 x 256 tile of the backward GEMMs (see gemm_wgmma.cuh, "backward"):
// the unit decode, the producer's TMA loads and the consumers' wgmma k-loop
// and epilogue, for the three operand/epilogue variants
//   kSwiGLU : dgrad, A K-major, B K-major [groups, n, k] (trans-b 0), SwiGLU-backward
//             epilogue (dg, du, w*a, per-tile partial dots of gd*a)
//   kSum2   : dgrad, K over [A0 | A1] x [B0 | B1] (both K-major), plain store
//   kWgrad  : A MN-major (trans-a 1), B MN-major (trans-b 1), K = the group's rows
//             (offsets read on the device), plain store into out[g]
// Shared by the staged kernels (gemm_wgmma_bwd.cu: one persistent launch per
// variant, static unit stride) and the backward megakernel (megakernel_bwd.cu:
// every variant in one launch, units from an atomic ticket), so both compute
// every tile with the same instructions in the same order: bitwise equal.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda_ptx.cuh"
#include "gemm_tile.cuh"
#include "gemm_wgmma.cuh"
#include "swiglu_bwd_epilogue.cuh"

namespace mok::cuda::bwd {

// The tile geometry and shared-memory layout are the forward's (gemm_tile.cuh).
using tile::kABytes;
using tile::kBK;
using tile::kBM;
using tile::kBN;
using tile::kConsumerWarps;
using tile::kStageBytes;
using tile::kStages;
using tile::kStgPitch;
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

// A dgrad unit (kSwiGLU, kSum2) at tile c.
__device__ __forceinline__ Unit dgrad_unit(const BParams& p, tile::TileCoord c) {
  Unit x;
  x.job = 0;
  x.row0 = 0;
  x.mt = c.mt;
  x.nt = c.nt;
  x.grp = p.tile_group ? p.tile_group[x.mt] : 0;
  x.skip = x.grp < 0;
  x.kb_count = p.k_blocks;
  x.m = p.m_rows;
  x.n = p.n;
  return x;
}

// Unit u of a staged launch (units in tile::raster order; wgrad: job by job,
// then group by group).
template <int kMode>
__device__ __forceinline__ Unit decode(const BParams& p, int u) {
  if (kMode != kWgrad) return dgrad_unit(p, tile::raster(u, p.m_tiles, p.n_tiles, p.group_m));
  Unit x;
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
  return x;
}

#if MOK_GEMM_TMA_STORE
using TmaStore = tile::TmaTileStore;
#else
struct TmaStore {};  // register-to-global builds: nothing stores through TMA
#endif

// MapsT: Maps, or any type with the load maps m[] (the megakernel's, which
// stores no tile through TMA and so carries no output maps).

// The producer thread's loads of unit x: its k blocks into the stage ring
// (`it` counts stages used, continued across units).
template <int kMode, class MapsT>
__device__ __forceinline__ void produce_unit(const MapsT& maps, const BParams& p, const Unit& x, uint8_t* smem,
                                             uint64_t* full_bar, uint64_t* empty_bar, uint32_t& it) {
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

// Which of this thread's two rows of a unit are live (keep) and their routing
// weights (wrow); the warp's rows start at wrow0. Read before the main loop so
// the dependent row_pair -> pair_weight loads overlap it.
template <int kMode>
__device__ __forceinline__ void unit_rows(const BParams& p, const Unit& x, int wrow0, int lane, bool (&keep)[2],
                                          float (&wrow)[2]) {
  const int row0 = wrow0 + (lane >> 2);
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
}

template <int kMode, bool kTma, class MapsT>
__device__ __forceinline__ void unit_epilogue(const MapsT& maps, const BParams& p, const Unit& x,
                                              float (&acc)[128], int wrow0, uint8_t* stg, int lane,
                                              const bool (&keep)[2], const float (&wrow)[2], TmaStore& tts);

// The wgmma k-loop of unit x into acc (zeros when x has no k blocks): waits
// for each stage (its phase from parity: tile::RingParity when this consumer
// waits on every stage use, tile::OwnedParity for the ping-pong kernels) and
// hands it back with release(stage) as soon as its wgmma retired. cw: which
// 64-row half of the stage's A holds this warpgroup's rows (0 where the stage
// holds only them).
template <int kMode, class Release, class Parity = tile::RingParity>
__device__ __forceinline__ void unit_k_loop(float (&acc)[128], uint8_t* smem, uint64_t* full_bar, uint32_t& it,
                                            const Unit& x, int cw, Release&& release, Parity parity = {}) {
  if (x.kb_count == 0) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  }
  uint32_t prev_s = 0;
  for (int kb = 0; kb < x.kb_count; ++kb, ++it) {
    const uint32_t s = it % kStages;
    ptx::mbar_wait(&full_bar[s], parity(s, it));
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
      release(prev_s);
    }
    prev_s = s;
  }
  ptx::wgmma_wait<0>();
  if (x.kb_count > 0) release(prev_s);
#pragma unroll
  for (int i = 0; i < 128; ++i) ptx::fence_operand(acc[i]);
}

// A consumer warpgroup's half (cw) of unit x: the k-loop into acc, each stage
// released to the producer as soon as its wgmma retired, then the variant's
// epilogue through this warp's staging buffer stg. kTma (only in
// -DMOK_GEMM_TMA_STORE=1 builds) stores through TMA (tts). A template
// argument, not a runtime branch, so each kernel holds one epilogue.
template <int kMode, bool kTma, class MapsT>
__device__ __forceinline__ void consume_unit(const MapsT& maps, const BParams& p, const Unit& x, float (&acc)[128],
                                             uint8_t* smem, uint64_t* full_bar, uint64_t* empty_bar, uint32_t& it,
                                             uint8_t* stg, int cw, int warp, int lane, TmaStore& tts) {
  const int wrow0 = x.mt * kBM + cw * 64 + warp * 16;
  bool keep[2];
  float wrow[2];
  unit_rows<kMode>(p, x, wrow0, lane, keep, wrow);
  unit_k_loop<kMode>(acc, smem, full_bar, it, x, cw, [&](uint32_t s) {
    if (lane == 0) ptx::mbar_arrive(&empty_bar[s]);
  });
  unit_epilogue<kMode, kTma>(maps, p, x, acc, wrow0, stg, lane, keep, wrow, tts);
}

// The epilogue of unit x for one consumer warp (rows from wrow0, all kBN
// columns of the unit) from its retired accumulators acc.
template <int kMode, bool kTma, class MapsT>
__device__ __forceinline__ void unit_epilogue(const MapsT& maps, const BParams& p, const Unit& x,
                                              float (&acc)[128], int wrow0, uint8_t* stg, int lane,
                                              const bool (&keep)[2], const float (&wrow)[2], TmaStore& tts) {
  (void)maps;
  (void)tts;
  const int row0 = wrow0 + (lane >> 2);
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
    if constexpr (kTma) {
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
  } else if constexpr (kTma) {
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

// ------------------------------------------------------------------ host side
// (gemm_wgmma_bwd.cu) The tensor maps and parameters of each variant for
// launch args a: nullptr, kEmpty (a dgrad without rows: nothing to launch) or
// an error. tma: whether the epilogue stores through TMA (only when
// allow_tma, in -DMOK_GEMM_TMA_STORE=1 builds, as MOK_CUDA_BWD_TMA_STORE picks).
inline constexpr char kEmpty[] = "empty";
const char* prepare_swiglu(const DgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma);
const char* prepare_sum2(const DgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma);
const char* prepare_wgrad(const WgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma);
#if MOK_GEMM_TMA_STORE
// (gemm_wgmma_bwd_pingpong.cu) The kSwiGLU dgrad with the TMA-store epilogue
// on ping-pong consumers, from prepare_swiglu's maps (their out maps) and p.
const char* launch_swiglu_pingpong(const DgradArgs& a, const Maps& maps, const BParams& p, int num_sms,
                                   cudaStream_t stream);
#endif

}  // namespace mok::cuda::bwd
