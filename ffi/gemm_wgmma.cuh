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
// MOK_CUDA_GEMM_CLUSTER=2 selects a 2-CTA cluster variant that multicasts the B
// stage to both CTAs (correct, but measured slower on H200; default is 1).
//
// Epilogues:
//   kGateUpSwiGLU: B0 = gate weights, B1 = up weights; a CTA covers 128 columns of
//     each (the 256-wide wgmma N is [gate 128 | up 128]); writes
//     out0 = bf16(gate), out1 = bf16(up), out2 = bf16(silu(gate) * up) from fp32.
//   kStore: out0 = bf16(acc), CTA covers 256 columns of B0.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace mok::cuda {

enum class GemmEpilogue : int { kGateUpSwiGLU = 0, kStore = 1 };

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
  void* out0 = nullptr;  // [m_rows, n]
  void* out1 = nullptr;  // [m_rows, n] (kGateUpSwiGLU only)
  void* out2 = nullptr;  // [m_rows, n] (kGateUpSwiGLU only)
  // Write zeros into the outputs of unused tiles (tile_group == -1).
  bool zero_unused_tiles = false;
};

// Requirements: k % 8 == 0, n % 8 == 0, all pointers 16-byte aligned, k, n > 0.
// Returns nullptr or a static error string. No host synchronisation.
const char* launch_grouped_gemm(GemmEpilogue epi, const GroupedGemmArgs& args, int num_sms,
                                cudaStream_t stream);

// Dynamic shared memory one GEMM CTA uses (for reports).
int grouped_gemm_smem_bytes();

}  // namespace mok::cuda
