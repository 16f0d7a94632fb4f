// The SwiGLU backward, fused into the epilogue of the down projection's dgrad
// (gemm_wgmma_bwd.cu, mode kSwiGLU): from gd = dy_row @ w_down^T (the fp32
// accumulators) and the saved pre-activations g, u of one routed row with
// routing weight w,
//   a  = bf16(silu(g) * u)            (the forward's activation, recomputed)
//   dg = w * gd * u * silu'(g),  du = w * gd * silu(g),  w_a = w * a
//   <gd, a> summed per row and 256-column tile (the router-weight gradient).
// Two writers of dg / du / w_a: register-to-global stores through the warp's
// staging buffer (in the kernel), and here, under -DMOK_GEMM_TMA_STORE=1, TMA
// stores from a ring of 1 KB regions per consumer warp (kRegions: 4 shipped).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cuda_ptx.cuh"
#include "gemm_tile.cuh"

namespace mok::cuda::swiglu_bwd {

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Two adjacent columns c = 0, 1 of one row: dg[c], du[c], w_a[c] (fp32), and
// <gd, a> added to `dot` where `live`.
__device__ __forceinline__ void pair(float2 gf, float2 uf, const float* gd2, float w, bool live, float& dot,
                                     float (&dg)[2], float (&du)[2], float (&aw)[2]) {
  const float g2[2] = {gf.x, gf.y}, u2[2] = {uf.x, uf.y};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float g = g2[c], uu = u2[c], gd = gd2[c];
    const float sg = 1.0f / (1.0f + __expf(-g));
    const float silu = g * sg;
    const float a = bf16_round(silu * uu);
    dot += live ? gd * a : 0.0f;
    const float da = w * gd;
    du[c] = da * silu;
    dg[c] = da * uu * sg * (1.0f + g * (1.0f - sg));
    aw[c] = w * a;
  }
}

#if MOK_GEMM_TMA_STORE
// One region: 16 rows x 32 bf16 columns (64 B), the box of a TMA store with
// the 64-byte swizzle: 16-byte chunk c of row r sits at chunk c ^ ((r / 2) % 4)
// of the row, so the 8 rows of a fragment access (and the 2 rows of a 16-byte
// access by 8 lanes) hit distinct banks. Regions sit on 1 KB boundaries (the
// swizzle repeats every 512 B).
constexpr int kRegionBytes = 1024;
#ifndef MOK_SWIGLU_BWD_AHEAD
#define MOK_SWIGLU_BWD_AHEAD 2
#endif
constexpr int kAhead = MOK_SWIGLU_BWD_AHEAD;  // chunks of g, u loaded ahead (1..4)
static_assert(kAhead >= 1 && kAhead <= 4, "MOK_SWIGLU_BWD_AHEAD: 1..4");
// As many regions as the warp's staging holds, of 4 or 8 (a tile's 24 stores
// must cycle the ring a whole number of times): 4 in the shipped build (two
// 2 KB TMA-store buffers per warp), 8 with MOK_GEMM_STG_BUFS >= 4.
constexpr int kRegions = tile::kTmaStgWarpBytes >= 8 * kRegionBytes ? 8 : 4;
static_assert(kRegions * kRegionBytes <= tile::kTmaStgWarpBytes, "the SwiGLU ring must fit the warp's staging");

// The epilogue of one consumer warp (16 rows from wrow0, 256 columns from
// n_base) in 8 chunks of 32 columns. Chunk ch issues stores 3ch, 3ch + 1,
// 3ch + 2 (dg, du, w_a) from regions (3ch + j) % kRegions: 24 stores per tile, so
// the region of every store is a compile-time constant and each tile starts
// the ring over. g and u arrive in dg's and du's regions (coalesced 16-byte
// loads, issued one chunk ahead), each thread reads its fragment's g, u and
// writes dg, du in their place (same thread, same address), and lane 0 stores
// the regions with TMA and waits only until the region it reuses next has
// been read out (rows past m and columns past n are clipped by the maps). The
// caller drains the stores before the CTA exits.
__device__ __forceinline__ void epilogue_tma(const float (&acc)[128], uint8_t* ring, int lane, int wrow0, int m,
                                             int n, int n_base, const bool (&keep)[2], const float (&wrow)[2],
                                             const __nv_bfloat16* gate_pre, const __nv_bfloat16* up_pre,
                                             const CUtensorMap* map_dg, const CUtensorMap* map_du,
                                             const CUtensorMap* map_aw, float (&dot)[2]) {
  static_assert((8 * 3) % kRegions == 0, "a tile's stores must end where the ring starts");
  const int colq = (lane & 3) * 2;
  // The swizzle term (r / 2) % 4 is (lane / 8) % 4 for every row this lane
  // touches (r = lane / 4 + 8h): the per-lane offsets, fragment access (chunk
  // gg) and 16-byte access (chunk lane % 4, rows r and r + 8: +512 B).
  const int sx = (lane >> 3) & 3;
  const int frag_row = (lane >> 2) * 64 + (lane & 3) * 4;
  int frag_off[4];
#pragma unroll
  for (int gg = 0; gg < 4; ++gg) frag_off[gg] = frag_row + ((gg ^ sx) << 4);
  const int vec_off = (lane >> 2) * 64 + (((lane & 3) ^ sx) << 4);
  // gu[b][0..1]: g of rows lane / 4 and 8 + lane / 4, columns 8 (lane % 4) +
  // [0, 8) of a chunk; gu[b][2..3]: u, same places. kAhead chunks in flight
  // (buffer ch % kAhead): the loads' latency, not DRAM, bounds this epilogue.
  uint4 gu[kAhead][4];
  auto load_gu = [&](int ch) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = wrow0 + (lane >> 2) + 8 * (i & 1), col = n_base + ch * 32 + (lane & 3) * 8;
      uint4& v = gu[ch % kAhead][i];
      v = make_uint4(0u, 0u, 0u, 0u);
      if (row < m && col < n)
        v = __ldg(reinterpret_cast<const uint4*>((i < 2 ? gate_pre : up_pre) + static_cast<size_t>(row) * n + col));
    }
  };
#pragma unroll
  for (int ch = 0; ch < kAhead; ++ch) load_gu(ch);
#pragma unroll  // acc[] indices and the regions must stay compile-time constants
  for (int ch = 0; ch < 8; ++ch) {
    uint8_t* rg = ring + ((3 * ch) % kRegions) * kRegionBytes;
    uint8_t* ru = ring + ((3 * ch + 1) % kRegions) * kRegionBytes;
    uint8_t* rw = ring + ((3 * ch + 2) % kRegions) * kRegionBytes;
    // rg and ru were last stored kRegions and kRegions - 1 stores ago: at most
    // the kRegions - 2 newest may still be reading.
    if (lane == 0) ptx::bulk_wait_group_read<kRegions - 2>();
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint4*>((i < 2 ? rg : ru) + vec_off + 512 * (i & 1)) = gu[ch % kAhead][i];
    __syncwarp();
    if (ch + kAhead < 8) load_gu(ch + kAhead);
    uint32_t pa[4][2];
#pragma unroll
    for (int gg = 0; gg < 4; ++gg) {
      const int col = n_base + ch * 32 + gg * 8 + colq;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int off = frag_off[gg] + 512 * h;
        const int i = (ch * 4 + gg) * 4 + h * 2;
        const bool live = keep[h] && col < n;
        float dg[2], du[2], aw[2];
        pair(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(rg + off)),
             __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(ru + off)), &acc[i], wrow[h], live, dot[h],
             dg, du, aw);
        *reinterpret_cast<uint32_t*>(rg + off) = live ? tile::pack_bf16x2(dg[0], dg[1]) : 0u;
        *reinterpret_cast<uint32_t*>(ru + off) = live ? tile::pack_bf16x2(du[0], du[1]) : 0u;
        pa[gg][h] = live ? tile::pack_bf16x2(aw[0], aw[1]) : 0u;
      }
    }
    const int col0 = n_base + ch * 32;
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
      ptx::tma_store_2d(map_dg, rg, col0, wrow0);
      ptx::bulk_commit_group();
      ptx::tma_store_2d(map_du, ru, col0, wrow0);
      ptx::bulk_commit_group();
      ptx::bulk_wait_group_read<kRegions - 1>();  // rw's last store (kRegions - 1 before rg's) has been read out
    }
    __syncwarp();
#pragma unroll
    for (int gg = 0; gg < 4; ++gg)
#pragma unroll
      for (int h = 0; h < 2; ++h) *reinterpret_cast<uint32_t*>(rw + frag_off[gg] + 512 * h) = pa[gg][h];
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
      ptx::tma_store_2d(map_aw, rw, col0, wrow0);
      ptx::bulk_commit_group();
    }
  }
}
#endif

}  // namespace mok::cuda::swiglu_bwd
