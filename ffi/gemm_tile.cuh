// The 128x256 wgmma CTA tile shared by the staged grouped GEMM (gemm_wgmma.cu)
// and the persistent forward megakernel (megakernel_fwd.cu): the shared-memory
// stage layout, the consumer K loop and the two epilogues.
//
// One CTA = 1 producer warpgroup (TMA) + 2 consumer warpgroups; consumer WG cw
// owns rows [64 cw, 64 cw + 64) of the tile and all 256 columns
// (wgmma m64n256k16, 128 fp32 accumulators per thread). A stage holds the A
// tile (128 rows x 64 K, 128-byte swizzle) and the B tile as 4 chunks of
// 64 N x 64 K (MN-major, read with wgmma's transpose-B bit).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cuda_ptx.cuh"

// Measurement only, never in a shipped build (tests/cuda/build_and_run.sh
// EXTRA_NVCC_FLAGS): MOK_GEMM_EPILOGUE_PROBE=1 drops the epilogues' global
// stores, forward (here) and backward (gemm_wgmma_bwd.cu; build_and_run_backward.sh)
// (benchmarks/RESULTS.md, "Epilogue probe"): the register-to-global stores
// only, so measure with MOK_CUDA_GEMM_TMA_STORE=0. Dropping the whole
// epilogue is no measurement: with the accumulators dead the MMAs go too.
#ifndef MOK_GEMM_EPILOGUE_PROBE
#define MOK_GEMM_EPILOGUE_PROBE 0
#endif

// The TMA-store epilogues (TmaTileStore here, swiglu_bwd::epilogue_tma) of
// the staged GEMMs (gemm_wgmma.cu, gemm_wgmma_bwd.cu): the default;
// -DMOK_GEMM_TMA_STORE=0 (MOK_JAX_GEMM_TMA_STORE=OFF) builds the
// register-to-global stores only, and MOK_CUDA_GEMM_TMA_STORE=0 selects them
// at run time (benchmarks/RESULTS.md, the A/B that made TMA the default).
#ifndef MOK_GEMM_TMA_STORE
#define MOK_GEMM_TMA_STORE 1
#endif

// Measurement only (tests/cuda/gpu_session_stages.sh, step waitprobe): with
// MOK_GEMM_WAIT_PROBE=1 one thread per consumer warpgroup of the staged
// forward GEMMs times its waits for stage data (clock64 around the full
// barrier wait), split by the k block's place in its tile: the first, the
// next three (loaded while the previous tile's epilogue ran) and the rest
// (steady state); gemm_wait_probe_read() returns the sums.
#ifndef MOK_GEMM_WAIT_PROBE
#define MOK_GEMM_WAIT_PROBE 0
#endif

// Measurement builds only (tests/cuda/gpu_session_stages.sh): the depth of
// the load ring and the number of 2 KB TMA-store staging buffers per consumer
// warp. The shipped 4 stages x 2 buffers and 3 stages x 5 buffers take the
// same shared memory (4 x 48 KB + 8 x 4 KB = 3 x 48 KB + 8 x 10 KB).
#ifndef MOK_GEMM_STAGES
#define MOK_GEMM_STAGES 4
#endif
#ifndef MOK_GEMM_STG_BUFS
#define MOK_GEMM_STG_BUFS 2
#endif

namespace mok::cuda::tile {

// The probe's sums for one consumer warpgroup: wait cycles and waits per
// bucket (k block 0, 1-3, 4+), then the consumer loop's cycles and tiles.
struct WaitProbe {
  unsigned long long v[8];
};

constexpr int kBM = 128;             // CTA rows (2 consumer WGs x 64)
constexpr int kBN = 256;             // wgmma N per consumer WG
constexpr int kBK = 64;              // K per stage (128 B of bf16: one swizzle row)
constexpr int kStages = MOK_GEMM_STAGES;
constexpr int kABytes = kBM * kBK * 2;   // 16 KB
constexpr int kBBytes = kBK * kBN * 2;   // 32 KB (4 chunks of 64 N x 64 K)
constexpr int kBChunk = kBK * 64 * 2;    // 8 KB
constexpr int kStageBytes = kABytes + kBBytes;
// Epilogue staging: each consumer warp owns 16 rows x 64 bf16 columns (+16 B pad
// per row: conflict-free 4-byte writes and 16-byte reads), flushed with
// coalesced 16-byte global stores.
constexpr int kStgPitch = 64 * 2 + 16;
constexpr int kStgWarpBytes = 16 * kStgPitch;
constexpr int kBarrierBytes = 256;   // mbarriers and small shared words
constexpr int kSmemBytes = kStages * kStageBytes + 1024 /*align slack*/ + kBarrierBytes + 8 * kStgWarpBytes;
// The staged grouped GEMM's layout (gemm_wgmma.cu): its epilogue stores
// through TMA (TmaTileStore), from kTmaStgBufs (2) 16 x 64 bf16 buffers per consumer warp
// (dense 128-byte rows, 128-byte swizzle, so each buffer sits on a 1024-byte
// boundary: the swizzle's 8-row period); the barriers take the first 256 B of
// the 1024 before them. The rows-to-addresses epilogue (TileStore with
// row_dst) uses the same per-warp region.
constexpr int kTmaStgOffset = kStages * kStageBytes + 1024;
constexpr int kTmaStgBufBytes = 16 * 128;
constexpr int kTmaStgBufs = MOK_GEMM_STG_BUFS;
static_assert(kTmaStgBufs >= 2, "TmaTileStore alternates at least two buffers");
constexpr int kTmaStgWarpBytes = kTmaStgBufs * kTmaStgBufBytes;
constexpr int kTmaGemmSmemBytes = 1024 /*align slack*/ + kTmaStgOffset + 8 * kTmaStgWarpBytes;
static_assert(kTmaGemmSmemBytes <= 227 * 1024, "the grouped GEMM's shared memory exceeds an SM's 227 KB");
static_assert(kBarrierBytes <= 1024 && kStgWarpBytes <= kTmaStgWarpBytes, "staging layout");
// The staged GEMMs' (gemm_wgmma.cu, gemm_wgmma_bwd.cu) shared memory and
// consumer-warp staging (warp w of consumer WG cw at kStagedStgOffset +
// (4 cw + w) * kStagedStgWarpBytes): the TMA-store layout in
// -DMOK_GEMM_TMA_STORE=1 builds, else the megakernel's.
#if MOK_GEMM_TMA_STORE
constexpr int kStagedGemmSmemBytes = kTmaGemmSmemBytes;
constexpr int kStagedStgOffset = kTmaStgOffset;
constexpr int kStagedStgWarpBytes = kTmaStgWarpBytes;
#else
constexpr int kStagedGemmSmemBytes = kSmemBytes;
constexpr int kStagedStgOffset = kStages * kStageBytes + kBarrierBytes;
constexpr int kStagedStgWarpBytes = kStgWarpBytes;
#endif
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float silu_mul(float g, float u) {
  return g * (1.0f / (1.0f + __expf(-g))) * u;
}

// Tile rasterisation shared by every persistent GEMM loop: unit u -> (m tile,
// n tile). Units walk down a band of `group_m` m tiles for one n tile, then the
// next n tile, then the next band. A wave of concurrent CTAs (one per SM) then
// reads about group_m A tiles and wave / group_m B tiles, which stay in L2;
// group_m = 1 is the plain m-major order, where a wave reads one A tile and
// n_tiles B tiles: for wide N (Mixtral's gate/up: 112 tiles of 2 MB) those
// outgrow L2 and each m tile re-reads the weights from HBM.
struct TileCoord {
  int mt, nt;
};
__device__ __forceinline__ TileCoord raster(int u, int m_tiles, int n_tiles, int group_m) {
  const int band_units = group_m * n_tiles;
  const int band = u / band_units;
  const int r = u - band * band_units;
  const int m0 = band * group_m;
  const int rows = min(group_m, m_tiles - m0);  // the last band may be shorter
  return {m0 + r % rows, r / rows};
}

// Zeros one consumer warp's share of an unused tile (no loads, no math: a
// tile of padding rows, written when the caller asks): rows row0 and row0 + 8
// (row0 = the warp's first row + lane / 4), the tile's columns from n_base
// (128 per output for the fused gate/up, 256 for the plain GEMM), 4 bytes per
// lane and step; outputs as the epilogues write them.
template <bool kFused, bool kKeepPre>
__device__ __forceinline__ void zero_warp_rows(int row0, int lane, int n_base, int m_rows, int n,
                                               __nv_bfloat16* out0, __nv_bfloat16* out1, __nv_bfloat16* out2) {
  const int colq = (lane & 3) * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + h * 8;
    if (row >= m_rows) continue;
    const size_t rbase = static_cast<size_t>(row) * n;
#pragma unroll
    for (int g = 0; g < (kFused ? 16 : 32); ++g) {
      const int col = n_base + g * 8 + colq;
      if (col >= n) continue;
      if (!kFused || kKeepPre) *reinterpret_cast<uint32_t*>(out0 + rbase + col) = 0u;
      if (kFused) {
        if (kKeepPre) *reinterpret_cast<uint32_t*>(out1 + rbase + col) = 0u;
        *reinterpret_cast<uint32_t*>(out2 + rbase + col) = 0u;
      }
    }
  }
}

// Which phase of a stage's full barrier a consumer waits for. RingParity:
// every use of every stage is waited on by this consumer (the cooperative
// kernels), so the phase follows from the ring position. OwnedParity: the
// ping-pong kernels, whose warpgroups each wait on their own barriers and only
// for the stage uses they own; a parity bit per stage, flipped at each wait
// (a parity from the ring position would alias: a barrier two phases behind
// passes a wait for the same parity at once).
struct RingParity {
  __device__ __forceinline__ uint32_t operator()(uint32_t, uint32_t it) const { return (it / kStages) & 1; }
};
struct OwnedParity {
  uint32_t& bits;
  __device__ __forceinline__ uint32_t operator()(uint32_t s, uint32_t) const {
    const uint32_t par = (bits >> s) & 1;
    bits ^= 1u << s;
    return par;
  }
};

// The consumer K loop of one tile: waits for each stage, issues 4 wgmma k16
// steps into `acc` (overwriting it at kb = 0), keeps one wgmma group in flight
// and hands each stage back with release(stage) once its MMAs retired.
// `it` is the running stage counter shared with the producer.
// probe, probe_on (MOK_GEMM_WAIT_PROBE builds only, else unused): the
// thread's sums, and whether this thread keeps them (a flag beside an always
// valid pointer: a pointer that is null on the other threads put the sums on
// the stack). parity: see RingParity / OwnedParity.
template <typename Release, typename Parity = RingParity>
__device__ __forceinline__ void mma_k_loop(float (&acc)[128], uint8_t* smem, uint64_t* full_bar, uint32_t& it,
                                           int k_blocks, int cw, Release&& release, WaitProbe* probe = nullptr,
                                           bool probe_on = false, Parity parity = {}) {
  (void)probe;
  (void)probe_on;
  uint32_t prev_s = 0;
  for (int kb = 0; kb < k_blocks; ++kb, ++it) {
    const uint32_t s = it % kStages;
    const uint32_t par = parity(s, it);
#if MOK_GEMM_WAIT_PROBE
    const long long t0 = clock64();
    ptx::mbar_wait(&full_bar[s], par);
    if (probe_on) {  // constant indices: the sums stay in registers
      const unsigned long long dt = static_cast<unsigned long long>(clock64() - t0);
      if (kb == 0) {
        probe->v[0] += dt, probe->v[1] += 1;
      } else if (kb < 4) {
        probe->v[2] += dt, probe->v[3] += 1;
      } else {
        probe->v[4] += dt, probe->v[5] += 1;
      }
    }
#else
    ptx::mbar_wait(&full_bar[s], par);
#endif
    const uint32_t a_base = ptx::smem_u32(smem + s * kStageBytes) + cw * (64 * 128);
    const uint32_t b_base = ptx::smem_u32(smem + s * kStageBytes + kABytes);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const uint64_t da = ptx::make_smem_desc_sw128(a_base + kk * 32, 16, 1024);
      const uint64_t db = ptx::make_smem_desc_sw128(b_base + kk * 2048, kBChunk, 1024);
      ptx::wgmma_m64n256k16_bf16<1>(acc, da, db, (kb | kk) != 0);
    }
    ptx::wgmma_commit();
    if (kb > 0) {
      ptx::wgmma_wait<1>();
      release(prev_s);
    }
    prev_s = s;
  }
  ptx::wgmma_wait<0>();
  release(prev_s);
#pragma unroll
  for (int i = 0; i < 128; ++i) ptx::fence_operand(acc[i]);
}

// Epilogue writer of one consumer warp: 16 rows starting at `wrow0`, staged
// 16 x 64 at a time through the warp's `stg` buffer. keep[h] = false writes
// zeros for the warp's row (lane/4 + 8h).
struct TileStore {
  uint8_t* stg;
  int lane;
  int wrow0;   // first row of this warp
  int m_rows;  // rows of the output (bound)
  int n;       // columns of the output (row pitch)
  bool keep[2];
  // Optional [m_rows] address of each output row (0: the row is not stored),
  // in place of out + row * n: rows go straight to where they belong (the
  // peer dispatch's owners' return rows, over NVLink).
  const uint64_t* row_dst = nullptr;

  __device__ __forceinline__ void put(int gg, int h, float v0, float v1) const {
    *reinterpret_cast<uint32_t*>(stg + ((lane >> 2) + h * 8) * kStgPitch + gg * 16 + (lane & 3) * 4) =
        keep[h] ? pack_bf16x2(v0, v1) : 0u;
  }
  __device__ __forceinline__ void flush(__nv_bfloat16* out, int col0) const {
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = lane + 32 * i;
      const int r = idx >> 3, c = idx & 7;
      const int row = wrow0 + r, col = col0 + c * 8;
      const uint4 v = *reinterpret_cast<const uint4*>(stg + r * kStgPitch + c * 16);
      if (row < m_rows && col < n) {
        __nv_bfloat16* dst = out + static_cast<size_t>(row) * n;
        if (row_dst != nullptr) dst = reinterpret_cast<__nv_bfloat16*>(row_dst[row]);
        if (dst != nullptr && MOK_GEMM_EPILOGUE_PROBE == 0) *reinterpret_cast<uint4*>(dst + col) = v;
      }
    }
    __syncwarp();
  }
};

// Epilogue writer of one consumer warp through TMA stores: each 16 x 64
// chunk is staged in one of the warp's kTmaStgBufs buffers, in turn, and stored by one
// cp.async.bulk.tensor issued by lane 0, so the warp goes on to the next
// chunk (and, after a tile's last chunk, to the next tile's MMAs) while the
// copy engine writes it: measured, the register-to-global stores of TileStore
// kept the consumers (and so the tensor cores) idle for 8 % of the gate/up
// GEMM and 22 % of the down GEMM (MOK_GEMM_EPILOGUE_PROBE=1, ncu, shape 1).
// Rows past the output's end are clipped by the tensor map; keep[h] = false
// writes zeros for the warp's row (lane/4 + 8h). One store object lives for
// the whole kernel: `slot` cycles across tiles too.
struct TmaTileStore {
  uint8_t* buf;  // the warp's kTmaStgBufs buffers of kTmaStgBufBytes, 1024-byte aligned
  int lane;
  int wrow0;     // first row of this warp in the current tile
  bool keep[2];
  uint32_t slot;
  int z = -1;    // >= 0: the map is 3-D [groups, rows, cols] and this is the group

  // Row r = lane/4 + 8h holds bytes [16 gg, 16 gg + 16) of its 128 at 16-byte
  // chunk gg ^ (r % 8) (the 128-byte swizzle): the 8 rows of one store
  // instruction land on 8 distinct bank groups.
  __device__ __forceinline__ void put(int gg, int h, float v0, float v1) const {
    const int r = (lane >> 2) + h * 8;
    *reinterpret_cast<uint32_t*>(buf + slot * kTmaStgBufBytes + r * 128 + ((gg ^ (r & 7)) << 4) + (lane & 3) * 4) =
        keep[h] ? pack_bf16x2(v0, v1) : 0u;
  }
  __device__ __forceinline__ void flush(const CUtensorMap* map, int col0) {
    ptx::fence_proxy_async_shared();  // this lane's writes, visible to the copy engine
    __syncwarp();
    if (lane == 0) {
      if (z >= 0)
        ptx::tma_store_3d(map, buf + slot * kTmaStgBufBytes, col0, wrow0, z);
      else
        ptx::tma_store_2d(map, buf + slot * kTmaStgBufBytes, col0, wrow0);
      ptx::bulk_commit_group();
      ptx::bulk_wait_group_read<kTmaStgBufs - 1>();  // the buffer written next has been read out
    }
    __syncwarp();
    if constexpr (kTmaStgBufs == 2) {
      slot ^= 1;  // the shipped build's code, unchanged
    } else {
      slot = slot + 1 == kTmaStgBufs ? 0u : slot + 1;
    }
  }
  // Before the CTA exits: every store of this warp complete.
  __device__ __forceinline__ void drain() const {
    if (lane == 0) ptx::bulk_wait_group<0>();
    __syncwarp();
  }
};

// Stages column chunk `ch` (64 columns) of the warp's 16 rows: v(i) is the
// value of accumulator slot i, for the chunk's slots i = (ch * 8 + gg) * 4 +
// h * 2 and i + 1 (see the wgmma accumulator layout in cuda_ptx.cuh).
template <typename Store, typename Value>
__device__ __forceinline__ void put_chunk(const Store& ts, int ch, Value&& v) {
#pragma unroll
  for (int gg = 0; gg < 8; ++gg)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = (ch * 8 + gg) * 4 + h * 2;
      ts.put(gg, h, v(i), v(i + 1));
    }
}

// Gate/up epilogue: the 256 accumulator columns are [gate 128 | up 128] of the
// CTA's 128 output columns starting at n_base; writes bf16 gate, up and
// silu(gate) * up (computed from the fp32 accumulators), or with kKeepPre =
// false the activation only (a forward that keeps no residuals: gate and up
// unused). Store: TileStore (Out = bf16 pointers) or TmaTileStore (Out = their
// tensor maps).
template <bool kKeepPre = true, typename Store, typename Out>
__device__ __forceinline__ void store_gate_up(const float (&acc)[128], Store& ts, int n_base, Out gate, Out up,
                                              Out act) {
#pragma unroll
  for (int ch = 0; ch < 2; ++ch) {
    if (kKeepPre) {
      put_chunk(ts, ch, [&](int i) { return acc[i]; });
      ts.flush(gate, n_base + ch * 64);
      put_chunk(ts, ch, [&](int i) { return acc[64 + i]; });
      ts.flush(up, n_base + ch * 64);
    }
    put_chunk(ts, ch, [&](int i) { return silu_mul(acc[i], acc[64 + i]); });
    ts.flush(act, n_base + ch * 64);
  }
}

// Plain epilogue: bf16(acc) into 256 columns starting at n_base.
template <typename Store, typename Out>
__device__ __forceinline__ void store_plain(const float (&acc)[128], Store& ts, int n_base, Out out) {
#pragma unroll
  for (int ch = 0; ch < 4; ++ch) {
    put_chunk(ts, ch, [&](int i) { return acc[i]; });
    ts.flush(out, n_base + ch * 64);
  }
}

}  // namespace mok::cuda::tile
