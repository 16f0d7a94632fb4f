// Backward GEMMs (see gemm_wgmma.cuh, "backward"): the forward's wgmma machinery
// (TMA 128B-swizzle loads into a 4-stage mbarrier ring, 1 producer WG + 2
// consumer WGs with setmaxnreg 40/232, persistent grid, 128x256 CTA tile of two
// m64n256k16 accumulators), one launch per operand/epilogue variant (kSwiGLU,
// kSum2, kWgrad: the tile itself is bwd_tile.cuh, shared with the backward
// megakernel).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "bwd_tile.cuh"
#include "cuda_problem.h"
#include "gemm_wgmma.cuh"

namespace mok::cuda {
namespace {

using namespace bwd;
constexpr int kKernelSmemBytes = tile::kStagedGemmSmemBytes;
using tile::kThreads;

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
        produce_unit<kMode>(maps, p, x, smem, full_bar, empty_bar, it);
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
    TmaStore tts{stg, lane, 0, {false, false}, 0u};
#else
    TmaStore tts;
#endif
    float acc[128];
    uint32_t it = 0;
    for (int u = blockIdx.x; u < p.units; u += gridDim.x) {
      const Unit x = decode<kMode>(p, u);
      if (x.skip) continue;
      consume_unit<kMode, kTma>(maps, p, x, acc, smem, full_bar, empty_bar, it, stg, cw, warp, lane, tts);
    }
#if MOK_GEMM_TMA_STORE
    if (kTma) tts.drain();  // every TMA store complete before the CTA exits
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
  if (a.m_rows <= 0) return kEmpty;
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
  p.group_m = gemm_group_m();
  return nullptr;
}

}  // namespace

namespace bwd {

const char* prepare_swiglu(const DgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma) {
  if (const char* e = dgrad_common(a, false, maps, p)) return e;
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
  tma = false;
#if MOK_GEMM_TMA_STORE
  tma = allow_tma && bwd_tma_store(kSwiGLU);
  if (tma) {
    void* outs[3] = {a.out0, a.out1, a.out2};
    for (int j = 0; j < 3; ++j)
      if (!make_map_2d(&maps.out[j], outs[j], a.m_rows, a.n, 32, 16, CU_TENSOR_MAP_SWIZZLE_64B))
        return "mok cuda bwd gemm: tensor map (output) encode failed";
  }
#endif
  return nullptr;
}

const char* prepare_sum2(const DgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma) {
  if (const char* e = dgrad_common(a, true, maps, p)) return e;
  p.row_dst = a.row_dst;
  // TMA-store epilogue (-DMOK_GEMM_TMA_STORE=1 builds): boxes of 64 columns x 16 rows of out0.
  tma = false;
#if MOK_GEMM_TMA_STORE
  tma = allow_tma && a.row_dst == nullptr && bwd_tma_store(kSum2);
  if (tma && !make_map_2d(&maps.out[0], a.out0, a.m_rows, a.n, 64, 16))
    return "mok cuda bwd gemm: tensor map (output) encode failed";
#endif
  return nullptr;
}

const char* prepare_wgrad(const WgradArgs& a, bool allow_tma, Maps& maps, BParams& p, bool& tma) {
  if (a.jobs < 1 || a.jobs > 3) return "mok cuda wgrad: 1..3 jobs";
  if (a.rows <= 0) return "mok cuda wgrad: no rows";
  if (a.rows > kMaxInt || a.groups <= 0 || a.groups > kMaxInt) return "mok cuda wgrad: dimension too large";
  if (encoder() == nullptr) return "mok cuda wgrad: cuTensorMapEncodeTiled unavailable";
  std::memset(&maps, 0, sizeof(maps));
  std::memset(&p, 0, sizeof(p));
  int64_t units = 0;
  tma = false;
#if MOK_GEMM_TMA_STORE
  tma = allow_tma && bwd_tma_store(kWgrad);
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
  p.group_m = gemm_group_m();
  return nullptr;
}

}  // namespace bwd

// The staged launches: one persistent kernel per variant.
const char* launch_dgrad_swiglu_bwd(const DgradArgs& a, int num_sms, cudaStream_t stream) {
  Maps maps;
  BParams p;
  bool tma;
  if (const char* e = prepare_swiglu(a, true, maps, p, tma)) return e == kEmpty ? nullptr : e;
#if MOK_GEMM_TMA_STORE
  if (tma && bwd_swiglu_pingpong()) return launch_swiglu_pingpong(a, maps, p, num_sms, stream);
#endif
  return launch<kSwiGLU>(maps, p, tma, num_sms, stream);
}

const char* launch_dgrad_sum2(const DgradArgs& a, int num_sms, cudaStream_t stream) {
  Maps maps;
  BParams p;
  bool tma;
  if (const char* e = prepare_sum2(a, true, maps, p, tma)) return e == kEmpty ? nullptr : e;
  return launch<kSum2>(maps, p, tma, num_sms, stream);
}

const char* launch_wgrad(const WgradArgs& a, int num_sms, cudaStream_t stream) {
  Maps maps;
  BParams p;
  bool tma;
  if (const char* e = prepare_wgrad(a, true, maps, p, tma)) return e;
  return launch<kWgrad>(maps, p, tma, num_sms, stream);
}

}  // namespace mok::cuda
