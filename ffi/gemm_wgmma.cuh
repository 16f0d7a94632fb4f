// Grouped bf16 GEMM for Hopper (sm_90a): wgmma (bf16 -> fp32), TMA loads into a
// multi-stage shared-memory ring guarded by mbarriers, one producer warpgroup and
// two consumer warpgroups (setmaxnreg 40 / 232), persistent grid with a static
// tile stride.
//
// Problem: for each 128-row tile m of A (rows are expert-major, every tile belongs
// to one group g = tile_group[m]), out[rows of m] = A[rows of m] @ B[g].
//   A : [m_rows, k]      bf16 row-major (K contiguous: wgmma K-major)
//   B : [groups, k, n]   bf16 row-major (N contiguous: wgmma MN-major, trans-b = 1)
// CTA tile 128 x 256 (2 consumer WGs x m64n256k16), K step 64, 4 stages of 48 KB,
// epilogue staged per warp through 18 KB of shared memory (coalesced 16-byte
// stores); 216,320 B dynamic smem, 168 regs at entry (setmaxnreg 40 / 232).
// Launched as clusters of 2 CTAs on adjacent m tiles that multicast the B stage
// to both (half the L2 reads of the weights; MOK_CUDA_GEMM_CLUSTER=1 launches
// single CTAs, for measurements).
//
// Epilogues:
//   kGateUpSwiGLU: B0 = gate weights, B1 = up weights; a CTA covers 128 columns of
//     each (the 256-wide wgmma N is [gate 128 | up 128]); writes
//     out0 = bf16(gate), out1 = bf16(up), out2 = bf16(silu(gate) * up) from fp32.
//   kStore: out0 = bf16(acc), CTA covers 256 columns of B0.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

namespace mok::cuda {

enum class GemmEpilogue : int { kGateUpSwiGLU = 0, kStore = 1 };

// The dispatch fused into the gate/up kernels (dispatch_fused.cuh): the
// kernel writes A itself, a[r] = x[row_pair[r] / top_k] (zeros where the pair
// is < 0) for r < *total_rows, before its TMA loads read them. x == nullptr:
// off. The caller fills the fields above `vec`; launch_grouped_gemm sets vec
// and dst from GroupedGemmArgs' k and a.
struct FusedDispatchParams {
  const uint4* x = nullptr;            // [T, H] token rows
  const int32_t* row_pair = nullptr;   // [R] pair t * K + k of each row, < 0 padding
  const int32_t* total_rows = nullptr; // device: rows in use (a multiple of 128)
  int32_t* sync = nullptr;             // [2 + ceil(m_rows / 128)], zero at launch
  int32_t* flags = nullptr;            // a wait that times out sets bit 1 and traps
  int top_k = 1;
  int window_tiles = 0;                // throttle: copy at most this many tiles past the GEMM's front (0 = none)
  int vec = 0;                         // H / 8
  uint4* dst = nullptr;                // A: the rows the TMA loads read
};

struct GroupedGemmArgs {
  const void* a = nullptr;  // [m_rows, k]
  int64_t m_rows = 0;
  int64_t k = 0;
  const void* b0 = nullptr;  // [groups, k, n]
  const void* b1 = nullptr;  // [groups, k, n] (kGateUpSwiGLU only)
  int64_t groups = 1;
  int64_t n = 0;
  // [ceil(m_rows/128)] group of each 128-row tile, -1 = unused tile (no loads, no
  // math). nullptr: every tile uses group 0.
  const int32_t* tile_group = nullptr;
  // Optional [m_rows]: rows whose mask is 0 are written as zeros.
  const uint8_t* row_mask = nullptr;
  // kGateUpSwiGLU: out0, out1 the gate/up pre-activations, out2 the
  // activation; out0 = out1 = nullptr writes the activation only.
  void* out0 = nullptr;  // [m_rows, n]
  void* out1 = nullptr;  // [m_rows, n] (kGateUpSwiGLU only)
  void* out2 = nullptr;  // [m_rows, n] (kGateUpSwiGLU only)
  // Write zeros into the outputs of unused tiles (tile_group == -1).
  bool zero_unused_tiles = false;
  // kStore only, optional: [m_rows] address of each output row (0 = not
  // stored) instead of out0 + row * n (out0 unused). Not with zero_unused_tiles.
  const uint64_t* row_dst = nullptr;
  // kGateUpSwiGLU only, optional: the dispatch fused in (see above).
  FusedDispatchParams dispatch = {};
};

// Requirements: k % 8 == 0, n % 8 == 0, all pointers 16-byte aligned, k, n > 0.
// Returns nullptr or a static error string. No host synchronisation.
const char* launch_grouped_gemm(GemmEpilogue epi, const GroupedGemmArgs& args, int num_sms,
                                cudaStream_t stream);

// Tensor maps of the tile (gemm_tile.cuh), 128-byte swizzle, bf16:
// 2-D map   [rows, cols] row-major, box box_cols x box_rows (the backward's maps);
// rows map  [rows, k] row-major, box 64 (K) x 128 (rows);
// weights map [groups, k, n] row-major, box 64 (N) x 64 (K) x 1.
// Return false when the driver's encoder is unavailable or rejects the map.
PFN_cuTensorMapEncodeTiled_v12000 get_encoder();
// Row-major bf16 [rows, cols], 128-byte swizzle unless `swizzle` says otherwise
// (the backward's 32-column TMA-store boxes use the 64-byte one).
bool make_map_2d(CUtensorMap* m, const void* ptr, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                 CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B);
// Row-major bf16 [groups, rows, cols] (a stack of matrices), 128-byte swizzle,
// box {box_cols, box_rows, 1}: a box never crosses into the next matrix.
bool make_map_3d_rows(CUtensorMap* m, const void* ptr, int64_t groups, int64_t rows, int64_t cols, uint32_t box_cols,
                      uint32_t box_rows);
bool make_map_a(CUtensorMap* m, const void* ptr, int64_t rows, int64_t k);
bool make_map_b(CUtensorMap* m, const void* ptr, int64_t groups, int64_t k, int64_t n);

// Rasterisation band (m tiles) of the persistent GEMM loops, see tile::raster:
// 8, or MOK_CUDA_GEMM_GROUP_M (read once) for measurements.
int gemm_group_m();
// In a -DMOK_GEMM_TMA_STORE=1 build: 1 unless MOK_CUDA_GEMM_TMA_STORE=0 (the
// register-to-global stores, for an A/B in one binary; the backward's three
// epilogues can also be picked one by one, MOK_CUDA_BWD_TMA_STORE in
// gemm_wgmma_bwd.cu).
int gemm_tma_store();

// launch_grouped_gemm runs on ping-pong consumers (gemm_wgmma_pingpong.cu:
// 2-CTA clusters, each consumer warpgroup owns whole 64 x 256 halves of the
// 128 x 256 units in turn; bitwise the same outputs) when its epilogue stores
// through TMA without per-row destinations and gemm_pingpong(fused, keep_pre,
// k_blocks) says so: MOK_CUDA_GEMM_PINGPONG=1 always, =0 never, unset only the
// fused gate/up GEMM that keeps its pre-activations (training: three outputs)
// with k_blocks <= kPingpongMaxKBlocks. The activation-only gate/up (one
// output) measured 9 % slower on ping-pong (H100, staged harness, shape 1,
// alternated), so it stays on the cooperative kernel. Measured (H200, staged
// harness, RESULTS.md nineteenth session): the fused gate/up at H = 2048 (32 k
// blocks) 12 % faster, at H = 4096 / 7168 5 % / 20 % slower, the plain down
// GEMM level or slower: a ping-pong warpgroup's 64-row half loads 24 KB per
// 2.1 MFLOP against the cooperative cluster kernel's 16, and the same 4-stage
// ring covers half the time, so it pays only where the heavy SwiGLU epilogue
// is a large share of a short K loop. PingpongGemm carries
// launch_grouped_gemm's encoded maps (A with a 64-row box) and tile counts.
constexpr int kPingpongMaxKBlocks = 32;
bool gemm_pingpong(bool fused, bool keep_pre, int k_blocks);
struct PingpongParams {  // the ping-pong kernel's scalars, passed to it as they are
  int m_rows, n, k_blocks, n_tiles, m_tiles, group_m;
  const int32_t* tile_group;
  const uint8_t* row_mask;
  __nv_bfloat16* out0;
  __nv_bfloat16* out1;
  __nv_bfloat16* out2;
  int zero_unused;
  FusedDispatchParams fd;
};
struct PingpongGemm {
  const CUtensorMap* a64;
  const CUtensorMap* b0;
  const CUtensorMap* b1;
  const CUtensorMap* out[3];
  PingpongParams p;
  bool fused, keep_pre;
};
const char* launch_grouped_gemm_pingpong(const PingpongGemm& g, int num_sms, cudaStream_t stream);

// Dynamic shared memory one GEMM CTA uses (for reports).
int grouped_gemm_smem_bytes();

// -DMOK_GEMM_WAIT_PROBE=1 builds (measurement): the probe's sums since the
// process started, out[8 j + i] for j = 0 gate/up, 1 plain, i = wait cycles
// and waits of k block 0, of 1-3, of 4+, consumer cycles, tiles (one thread
// per consumer warpgroup). false in other builds.
bool gemm_wait_probe_read(unsigned long long out[16]);

// Clusters of `cluster` (1 or 2) CTAs of the GEMM kernel that can be resident at
// once (cudaOccupancyMaxActiveClusters, cached): the persistent grid. 0 when the
// query failed (the launch then assumes num_sms / cluster).
int grouped_gemm_resident_clusters(GemmEpilogue epi, int cluster, int num_sms);

// ------------------------------------------------------------------ backward
// Backward GEMMs (gemm_wgmma_bwd.cu), same machinery (128x256 CTA tile, K step
// 64, 4-stage TMA/mbarrier ring, 1 producer + 2 consumer WGs, persistent grid).
//
// Dgrad with K-major B: for each 128-row tile m of A (group g = tile_group[m],
// -1 = unused: skipped, nothing written),
//   out[rows of m] = sum_h A_h[rows of m] @ B_h[g]^T
//   A_h : [m_rows, k] bf16 row-major (K-major)
//   B_h : [groups, n, k] bf16 row-major (K-major: wgmma trans-b = 0)
// Epilogues:
//   launch_dgrad_swiglu_bwd (one term h = 0; the accumulator is gd = dy @ W_down^T):
//     with g = gate_pre[row], u = up_pre[row] (bf16), s = sigmoid(g),
//     a = bf16(silu(g) u) and the row's weight w (pair_weight[row_pair[row]] when
//     row_pair is given, else 1):
//       out0 = bf16(w gd u s (1 + g (1 - s)))   (d gate)
//       out1 = bf16(w gd silu(g))               (d up)
//       out2 = bf16(w a)                        (scaled activation, for dW_down)
//       part[row * n_tiles + n_tile] = sum over the tile's columns of gd * a (fp32,
//         fixed order), n_tiles = ceil(n / 256)
//     Rows that are padding (row_pair < 0) or masked (row_mask == 0) are written as
//     zeros (part too).
//   launch_dgrad_sum2 (two terms: K runs over [A_0 | A_1] against [B_0 | B_1]):
//     out0 = bf16(acc); with row_dst, row r goes to address row_dst[r] instead
//     (0 = not stored; the peer backward's d_x rows, straight to their owners).
struct DgradArgs {
  const void* a0 = nullptr;
  const void* a1 = nullptr;
  int64_t m_rows = 0;
  int64_t k = 0;
  const void* b0 = nullptr;
  const void* b1 = nullptr;
  int64_t groups = 1;
  int64_t n = 0;
  const int32_t* tile_group = nullptr;  // nullptr: every tile uses group 0
  // SwiGLU-backward epilogue
  const void* gate_pre = nullptr;  // [m_rows, n]
  const void* up_pre = nullptr;    // [m_rows, n]
  const int32_t* row_pair = nullptr;
  const float* pair_weight = nullptr;
  const uint8_t* row_mask = nullptr;
  const uint64_t* row_dst = nullptr;  // launch_dgrad_sum2 only (out0 unused then)
  void* out0 = nullptr;
  void* out1 = nullptr;
  void* out2 = nullptr;
  float* part = nullptr;  // may be nullptr (not written)
};
const char* launch_dgrad_swiglu_bwd(const DgradArgs& args, int num_sms, cudaStream_t stream);
// launch_dgrad_swiglu_bwd runs on ping-pong consumers (gemm_wgmma_bwd_pingpong.cu:
// 2-CTA clusters, bitwise the same results) when its epilogue stores through TMA
// (the default) unless MOK_CUDA_BWD_PINGPONG=0: bwd_swiglu_pingpong(). Measured
// 1-5 % faster than the cooperative kernel at the four benchmark shapes (H200).
bool bwd_swiglu_pingpong();
const char* launch_dgrad_sum2(const DgradArgs& args, int num_sms, cudaStream_t stream);

// Wgrad with MN-major A (wgmma trans-a = 1) and ragged K: for up to 3 jobs j and
// each group g with rows [off[g], off[g+1]) (offsets read on the device; nullptr
// = one group of rows [0, rows)),
//   out_j[g] ([m_j, n_j], bf16) = A_j[rows of g]^T @ B_j[rows of g]
//   A_j : [rows, m_j] bf16 row-major,  B_j : [rows, n_j] bf16 row-major.
// K advances in steps of 64 rows; rows past a group's end must be zero in A or B
// (segments are 128-padded with zero padding rows; rows past `rows` are TMA zero
// fill). Groups with no rows get exact zeros.
struct WgradJob {
  const void* a = nullptr;
  int64_t m = 0;
  const void* b = nullptr;
  int64_t n = 0;
  void* out = nullptr;
};
struct WgradArgs {
  WgradJob job[3];
  int jobs = 0;
  int64_t rows = 0;
  int64_t groups = 1;
  const int32_t* offsets = nullptr;
};
const char* launch_wgrad(const WgradArgs& args, int num_sms, cudaStream_t stream);

}  // namespace mok::cuda
