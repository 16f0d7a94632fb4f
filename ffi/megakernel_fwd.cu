// The persistent forward megakernel (see megakernel_fwd.cuh for the protocol).
#include "megakernel_fwd.cuh"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>

#include "combine_row.cuh"
#include "cuda_ptx.cuh"
#include "gemm_tile.cuh"
#include "gemm_wgmma.cuh"
#include "megakernel_sync.cuh"

namespace mok::cuda {
namespace {

using tile::kABytes;
using tile::kBChunk;
using tile::kBK;
using tile::kBM;
using tile::kSmemBytes;
using tile::kStageBytes;
using tile::kStages;
using tile::kStgWarpBytes;
using tile::kThreads;

// Counter words (int32) at the start of the counter region, then
// ready[minibatches] and gu_done[minibatches].
enum Counter : int { kTicket = 0, kRole = 1, kDispatchTicket = 2, kDownDone = 3, kHeaderWords = 8 };
constexpr int kTaskSlots = 2;           // task hand-over ring (producer -> consumers)
constexpr int kDispatchWarps = kThreads / 32;
constexpr int kConsumerThreads = 256;
constexpr int kCombineBarrier = 2;      // producer warp -> consumers: every down task is done
struct MegaParams {
  const uint4* peer_x[kMaxPeers];
  int64_t tokens_per_peer;
  int T, H, F, K, E, R;
  int mb_rows, mb_tiles, slots, minibatches;
  int dispatch_ctas, lag;
  int nb_gu, nb_d, kb_gu, kb_d;
  const int32_t* expert_offsets;
  const int32_t* tile_expert;
  const int32_t* row_pair;
  const int32_t* pair_row;
  const float* topk_weights;
  const uint8_t* token_mask;
  uint4* ring;
  __nv_bfloat16* gate_pre;
  __nv_bfloat16* up_pre;
  __nv_bfloat16* act;
  __nv_bfloat16* routed_out;
  const uint4* shared_out;
  uint4* y;
  int32_t* ctr;
  int32_t* flags;
};

// ------------------------------------------------------------ sync helpers
using namespace sync;

// The producer warp waits for the last down task (a spin loop in the
// consumers' code, after their task loop, made ptxas spill ~300 B per thread
// at the 168-register cap) and releases the consumers into the combine.
__device__ __forceinline__ void combine_bar_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kCombineBarrier), "n"(kConsumerThreads + 32) : "memory");
}
__device__ __forceinline__ void combine_bar_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kCombineBarrier), "n"(kConsumerThreads + 32) : "memory");
}

// ------------------------------------------------------------ task order
struct Task {
  int kind;  // 0 gate/up, 1 down, -1 no task left
  int m;     // minibatch
  int r;     // index inside the minibatch's tasks of that kind
};

// Ticket -> task: phases p = 0 .. n_mb + lag - 1; phase p holds the gate/up
// tasks of minibatch p (p < n_mb) and then the down tasks of minibatch
// p - lag (p >= lag). A down task of minibatch m therefore has a larger ticket
// than every gate/up task of m.
__device__ __forceinline__ Task decode_ticket(int tk, int n_mb, int lag, int gu_sz, int d_sz) {
  const int lag_eff = min(lag, n_mb);
  const int head = lag_eff * gu_sz;
  if (tk < head) return {0, tk / gu_sz, tk % gu_sz};
  tk -= head;
  const int per = gu_sz + d_sz;
  const int mid = (n_mb - lag_eff) * per;
  if (tk < mid) {
    const int ph = lag_eff + tk / per, r = tk % per;
    return r < gu_sz ? Task{0, ph, r} : Task{1, ph - lag, r - gu_sz};
  }
  tk -= mid;
  if (tk < lag_eff * d_sz) return {1, n_mb - lag_eff + tk / d_sz, tk % d_sz};
  return {-1, 0, 0};
}

__device__ __forceinline__ int tiles_in(int m, int mb_tiles, int n_tiles) {
  return min(mb_tiles, n_tiles - m * mb_tiles);
}

// ------------------------------------------------------------ dispatch role
// A dispatch unit is 256 16-byte vectors of one ring row (8 per lane); a
// warp keeps several units (12 KB with three) of loads in flight. The copy is latency-bound:
// one row at a time per warp, its index read first, pulled only ~20 GB/s per
// CTA (measured: 4 dispatch CTAs made the shape-1 forward dispatch-bound at
// 12 ms), so the minibatch's source rows are looked up once into shared
// memory and then every load of a batch is independent.
// Three units keep the dispatch role spill-free at the 168-register cap (four
// spill a register); MOK_DISPATCH_UNITS overrides it for measurements.
#ifndef MOK_DISPATCH_UNITS
#define MOK_DISPATCH_UNITS 3
#endif
constexpr int kUnitVecs = 256;
constexpr int kUnitsInFlight = MOK_DISPATCH_UNITS;

// src[rr]: the vector offset of ring row rr's token row in the peer table
// (peer << 40 | vector index in that peer), or -1 for a padding row (zeros).
__device__ __forceinline__ void lookup_sources(const MegaParams& p, int row0, int rows, int64_t* src) {
  const int vec = p.H / 8;
  for (int rr = threadIdx.x; rr < rows; rr += kThreads) {
    const int pr = p.row_pair[row0 + rr];
    if (pr < 0) {
      src[rr] = -1;
      continue;
    }
    const int64_t t = pr / p.K;
    const int64_t peer = t / p.tokens_per_peer;
    src[rr] = (peer << 40) | ((t - peer * p.tokens_per_peer) * vec);
  }
}

__device__ __forceinline__ void copy_minibatch(const MegaParams& p, int rows, const int64_t* src, uint4* slot,
                                               int warp, int lane) {
  const int vec = p.H / 8;
  const int units_per_row = (vec + kUnitVecs - 1) / kUnitVecs;
  const int units = rows * units_per_row;
  for (int u0 = warp; u0 < units; u0 += kUnitsInFlight * kDispatchWarps) {
    uint4 v[kUnitsInFlight][8];
#pragma unroll
    for (int j = 0; j < kUnitsInFlight; ++j) {
      const int u = u0 + j * kDispatchWarps;
      const int rr = u / units_per_row;
      const int c0 = (u - rr * units_per_row) * kUnitVecs + lane;
      const int64_t s = u < units ? src[rr] : -1;
      const uint4* row = s < 0 ? nullptr : p.peer_x[s >> 40] + (s & ((int64_t(1) << 40) - 1));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = c0 + i * 32;
        v[j][i] = (row != nullptr && c < vec) ? __ldg(row + c) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnitsInFlight; ++j) {
      const int u = u0 + j * kDispatchWarps;
      if (u >= units) break;
      const int rr = u / units_per_row;
      const int c0 = (u - rr * units_per_row) * kUnitVecs + lane;
      uint4* dst = slot + static_cast<size_t>(rr) * vec;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = c0 + i * 32;
        if (c < vec) dst[c] = v[j][i];
      }
    }
  }
}

// src: shared memory for minibatch_rows int64 (the GEMM stages, unused until
// this CTA joins the compute).
__device__ void dispatch_role(const MegaParams& p, int role, int n_used, int n_tiles, int n_mb, int* bcast,
                              int64_t* src) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int vec = p.H / 8;
  int32_t* ready = p.ctr + kHeaderWords;
  int32_t* gu_done = ready + p.minibatches;
  for (;;) {
    if (threadIdx.x == 0) {
      const int m = atomicAdd(&p.ctr[kDispatchTicket], 1);
      if (m < n_mb && m >= p.slots) {
        // The slot still holds minibatch m - slots: wait until its gate/up tasks are done.
        const int old = m - p.slots;
        wait_at_least(&gu_done[old], tiles_in(old, p.mb_tiles, n_tiles) * p.nb_gu, p.flags);
        fence_proxy_async_global();  // the TMA reads of the old rows precede our overwrite
      }
      *bcast = m;
    }
    __syncthreads();
    const int m = *bcast;
    __syncthreads();
    if (m >= n_mb) break;
    const int row0 = m * p.mb_rows;
    const int rows = min(p.mb_rows, n_used - row0);
    uint4* slot = p.ring + static_cast<size_t>(m % p.slots) * p.mb_rows * vec;
    lookup_sources(p, row0, rows, src);
    __syncthreads();
    copy_minibatch(p, rows, src, slot, warp, lane);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      st_release(&ready[m], 1);
    }
  }
  // Rows past the last used tile get zero residuals (the staged path does the same).
  const int fvec = p.F / 8;
  for (int64_t row = n_used + int64_t(role) * kDispatchWarps + warp; row < p.R;
       row += int64_t(p.dispatch_ctas) * kDispatchWarps) {
    uint4* g = reinterpret_cast<uint4*>(p.gate_pre) + row * fvec;
    uint4* u = reinterpret_cast<uint4*>(p.up_pre) + row * fvec;
    for (int c = lane; c < fvec; c += 32) {
      g[c] = make_uint4(0, 0, 0, 0);
      u[c] = make_uint4(0, 0, 0, 0);
    }
  }
}

// ------------------------------------------------------------ combine role
// Fixed k order, fp32, then the shared expert (combine_row.cuh, bitwise the
// staged combine). Each thread takes two tokens at a time and loads up to
// kCombineChunk rows of each before adding: one token at a time left the
// combine latency-bound at ~2x the staged kernel's time (it has 8x the
// resident threads). Not inlined, to keep the kernel's register allocation
// for the task loop.
constexpr int kCombineChunk = 8;
constexpr int kCombineTokens = 2;

__device__ __noinline__ void combine_tokens(const MegaParams& p, int ct) {
  const int vec = p.H / 8;
  const uint4* out = reinterpret_cast<const uint4*>(p.routed_out);
  const int64_t step = int64_t(gridDim.x) * kCombineTokens;
  for (int64_t t0 = blockIdx.x; t0 < p.T; t0 += step) {
    int64_t tok[kCombineTokens];
    bool live[kCombineTokens];
#pragma unroll
    for (int j = 0; j < kCombineTokens; ++j) {
      tok[j] = t0 + int64_t(j) * gridDim.x;
      live[j] = tok[j] < p.T && p.token_mask[tok[j]] != 0;
    }
    for (int c = ct; c < vec; c += kConsumerThreads) {
      float a[kCombineTokens][8];
#pragma unroll
      for (int j = 0; j < kCombineTokens; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) a[j][i] = 0.f;
      for (int k0 = 0; k0 < p.K; k0 += kCombineChunk) {
        uint4 v[kCombineTokens][kCombineChunk];
#pragma unroll
        for (int j = 0; j < kCombineTokens; ++j)
#pragma unroll
          for (int kk = 0; kk < kCombineChunk; ++kk) {
            const int k = k0 + kk;
            const int32_t r = (live[j] && k < p.K) ? p.pair_row[tok[j] * p.K + k] : -1;
            // Plain (coherent) load: these rows were written during this kernel.
            v[j][kk] = r >= 0 ? out[int64_t(r) * vec + c] : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
        for (int j = 0; j < kCombineTokens; ++j)
#pragma unroll
          for (int kk = 0; kk < kCombineChunk; ++kk) {
            const int k = k0 + kk;
            if (!live[j] || k >= p.K) continue;
            if (p.pair_row[tok[j] * p.K + k] >= 0) combine_acc8(a[j], v[j][kk], p.topk_weights[tok[j] * p.K + k]);
          }
      }
#pragma unroll
      for (int j = 0; j < kCombineTokens; ++j) {
        if (tok[j] >= p.T) continue;
        if (live[j] && p.shared_out) combine_acc8(a[j], __ldg(p.shared_out + tok[j] * vec + c), 1.0f);
        p.y[tok[j] * vec + c] = live[j] ? combine_pack8(a[j]) : make_uint4(0, 0, 0, 0);
      }
    }
  }
}

// ------------------------------------------------------------ the kernel
__global__ void __launch_bounds__(kThreads, 1)
    moe_forward_megakernel(const __grid_constant__ CUtensorMap tm_ring, const __grid_constant__ CUtensorMap tm_wg,
                           const __grid_constant__ CUtensorMap tm_wu, const __grid_constant__ CUtensorMap tm_act,
                           const __grid_constant__ CUtensorMap tm_wd, const __grid_constant__ MegaParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* task_full = empty_bar + kStages;
  uint64_t* task_empty = task_full + kTaskSlots;
  int4* task_info = reinterpret_cast<int4*>(task_empty + kTaskSlots);
  int* bcast = reinterpret_cast<int*>(task_info + kTaskSlots);
  // Finished tasks, consumers -> signaller warp (which publishes them).
  uint64_t* done_full = reinterpret_cast<uint64_t*>(bcast + 4);
  uint64_t* done_empty = done_full + kTaskSlots;
  int2* done_info = reinterpret_cast<int2*>(done_empty + kTaskSlots);
  static_assert(8 * (2 * kStages + 2 * kTaskSlots) + 16 * kTaskSlots + 16 + 16 * kTaskSlots + 8 * kTaskSlots <=
                    tile::kBarrierBytes,
                "barrier area");
  static_assert(8 * 8192 <= kStages * kStageBytes, "dispatch source table (minibatch_rows <= 8192)");

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&empty_bar[s], tile::kConsumerWarps);
    }
    for (int s = 0; s < kTaskSlots; ++s) {
      ptx::mbar_init(&task_full[s], 1);
      ptx::mbar_init(&task_empty[s], 32 * tile::kConsumerWarps);  // every consumer thread
      ptx::mbar_init(&done_full[s], tile::kConsumerWarps);
      ptx::mbar_init(&done_empty[s], 1);
    }
    ptx::fence_barrier_init();
    bcast[1] = atomicAdd(&p.ctr[kRole], 1);  // roles go to CTAs in the order they start
  }
  __syncthreads();
  const int role = bcast[1];
  const int n_used = p.expert_offsets[p.E];  // padded rows in use (a multiple of 128)
  const int n_tiles = n_used / kBM;
  const int n_mb = (n_tiles + p.mb_tiles - 1) / p.mb_tiles;
  const int gu_sz = p.mb_tiles * p.nb_gu, d_sz = p.mb_tiles * p.nb_d;
  int32_t* ready = p.ctr + kHeaderWords;
  int32_t* gu_done = ready + p.minibatches;

  if (role < p.dispatch_ctas) {
    dispatch_role(p, role, n_used, n_tiles, n_mb, bcast, reinterpret_cast<int64_t*>(smem));
    // Generic-proxy writes to the stage buffers before the TMA writes into them.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      ptx::tma_prefetch_desc(&tm_ring);
      ptx::tma_prefetch_desc(&tm_wg);
      ptx::tma_prefetch_desc(&tm_wu);
      ptx::tma_prefetch_desc(&tm_act);
      ptx::tma_prefetch_desc(&tm_wd);
      uint32_t it = 0, q = 0;
      // The next ticket is claimed while this one's loads are issued, so the
      // atomic's round trip is off the path between two tasks. Holding one
      // ticket ahead cannot deadlock: the lowest unfinished ticket is always
      // the one its CTA is working on, and its waits point lower still.
      int next = atomicAdd(&p.ctr[kTicket], 1);
      for (;;) {
        const Task t = decode_ticket(next, n_mb, p.lag, gu_sz, d_sz);
        if (t.kind >= 0) next = atomicAdd(&p.ctr[kTicket], 1);
        int tile = -1, nb = 0;
        if (t.kind >= 0) {
          // n-major inside the minibatch (tile::raster with the minibatch as
          // the band): a wave shares each weight tile across the band's rows.
          tile = t.m * p.mb_tiles + t.r % p.mb_tiles;
          nb = t.r / p.mb_tiles;
          if (tile >= n_tiles) continue;  // a tile slot of the last, partial minibatch
          if (t.kind == 0)
            wait_at_least(&ready[t.m], 1, p.flags);
          else
            wait_at_least(&gu_done[t.m], tiles_in(t.m, p.mb_tiles, n_tiles) * p.nb_gu, p.flags);
          fence_proxy_async_global();  // rows written by other CTAs, read next by TMA
        }
        const uint32_t qs = q % kTaskSlots;
        ptx::mbar_wait(&task_empty[qs], ((q / kTaskSlots) & 1) ^ 1);
        task_info[qs] = make_int4(t.kind, tile, nb, t.m);
        ptx::mbar_arrive(&task_full[qs]);
        ++q;
        if (t.kind < 0) break;
        const int grp = p.tile_expert[tile];
        const bool gu = t.kind == 0;
        const int a_row = gu ? (t.m % p.slots) * p.mb_rows + (tile - t.m * p.mb_tiles) * kBM : tile * kBM;
        const int k_blocks = gu ? p.kb_gu : p.kb_d;
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const uint32_t s = it % kStages;
          ptx::mbar_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
          uint8_t* sa = smem + s * kStageBytes;
          uint8_t* sb = sa + kABytes;
          ptx::mbar_arrive_expect_tx(&full_bar[s], kStageBytes);
          ptx::tma_load_2d(sa, gu ? &tm_ring : &tm_act, kb * kBK, a_row, &full_bar[s]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            // gate/up: the 256 columns are [gate 128 | up 128] of output block nb.
            const CUtensorMap* map = gu ? (j >= 2 ? &tm_wu : &tm_wg) : &tm_wd;
            const int ncol = gu ? nb * 128 + (j & 1) * 64 : nb * 256 + j * 64;
            ptx::tma_load_3d(sb + j * kBChunk, map, ncol, kb * kBK, grp, &full_bar[s]);
          }
        }
      }
    }
    if (threadIdx.x == 32) {
      // Signaller (warp 1): publishes each finished task with a gpu-scope
      // fence and a release add, so the consumers never stall on the fence
      // (one consumer thread doing it stalled its warpgroup's next wgmma).
      for (uint32_t n = 0;; ++n) {
        const uint32_t ds = n % kTaskSlots;
        ptx::mbar_wait(&done_full[ds], (n / kTaskSlots) & 1);
        const int2 info = done_info[ds];
        if (info.x < 0) break;
        __threadfence();
        red_release_add(info.x == 0 ? &gu_done[info.y] : &p.ctr[kDownDone], 1);
        ptx::mbar_arrive(&done_empty[ds]);
      }
    }
    if (threadIdx.x < 32) {  // warp 0 lets the consumers into the combine
      if (threadIdx.x == 0) wait_at_least(&p.ctr[kDownDone], n_tiles * p.nb_d, p.flags);
      __syncwarp();
      combine_bar_arrive();
    }
  } else {
    // ------------------------------------------------------------ consumers
    ptx::setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int warp = (threadIdx.x / 32) & 3;
    const int lane = threadIdx.x & 31;
    uint8_t* stg = smem + kStages * kStageBytes + tile::kBarrierBytes + (cw * 4 + warp) * kStgWarpBytes;
    auto release = [&](uint32_t s) {
      if (lane == 0) ptx::mbar_arrive(&empty_bar[s]);
    };
    // Task n's end goes to the signaller through done slot n % kTaskSlots:
    // each warp's stores, __syncwarp, then its lane 0 arrives (release);
    // thread 128 also writes what was done (-1: no task left).
    auto hand_over = [&](uint32_t n, int kind, int m) {
      const uint32_t ds = n % kTaskSlots;
      __syncwarp();
      if (lane == 0) {
        ptx::mbar_wait(&done_empty[ds], ((n / kTaskSlots) & 1) ^ 1);
        if (threadIdx.x == 128) done_info[ds] = make_int2(kind, m);
        ptx::mbar_arrive(&done_full[ds]);
      }
      __syncwarp();
    };
    uint32_t it = 0, q = 0;
    for (;;) {
      const uint32_t qs = q % kTaskSlots;
      ptx::mbar_wait(&task_full[qs], (q / kTaskSlots) & 1);
      const int4 info = task_info[qs];
      // Every reader arrives itself (release after its own read), so the
      // producer's next write of the slot is ordered after all reads
      // (racecheck flagged the one-lane-per-warp arrive after __syncwarp).
      ptx::mbar_arrive(&task_empty[qs]);
      ++q;
      if (info.x < 0) {
        hand_over(q - 1, -1, 0);
        break;
      }
      const bool gu = info.x == 0;
      const int tile = info.y, nb = info.z, m = info.w;
      // Each kind gets its own accumulator scope: sharing one across both
      // epilogues made ptxas spill ~1 KB per thread at the 168-register cap.
      if (gu) {
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        tile::mma_k_loop(acc, smem, full_bar, it, p.kb_gu, cw, release);
        tile::TileStore ts{stg, lane, tile * kBM + cw * 64 + warp * 16, p.R, p.F, {true, true}};
        tile::store_gate_up(acc, ts, nb * 128, p.gate_pre, p.up_pre, p.act);
      } else {
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        tile::mma_k_loop(acc, smem, full_bar, it, p.kb_d, cw, release);
        tile::TileStore ts{stg, lane, tile * kBM + cw * 64 + warp * 16, p.R, p.H, {true, true}};
        tile::store_plain(acc, ts, nb * 256, p.routed_out);
      }
      hand_over(q - 1, info.x, m);
    }

    // ------------------------------------------------------------ combine
    combine_bar_sync();
    combine_tokens(p, threadIdx.x - 128);
  }
}

}  // namespace

const char* resolve_megakernel(const Problem& p, const MegakernelConfig& cfg, MegakernelPlan* plan) {
  if (cfg.dispatch_ctas < 0 || cfg.dispatch_ctas > 64) return "mok cuda megakernel: dispatch_ctas must be in [1, 64]";
  if (cfg.minibatch_rows < 0 || cfg.minibatch_rows % 128 != 0 || cfg.minibatch_rows > 8192)
    return "mok cuda megakernel: minibatch_rows must be a positive multiple of 128, at most 8192";
  if (cfg.ring_rows < 0 || cfg.ring_rows % 128 != 0) return "mok cuda megakernel: ring_rows must be a positive multiple of 128";
  MegakernelPlan P;
  P.dispatch_ctas = cfg.dispatch_ctas ? cfg.dispatch_ctas : kDefaultDispatchCtas;
  P.minibatch_rows = cfg.minibatch_rows;
  if (P.minibatch_rows == 0) {  // the default, halved until it divides a given ring
    P.minibatch_rows = kDefaultMinibatchRows;
    while (cfg.ring_rows != 0 && cfg.ring_rows % P.minibatch_rows != 0) P.minibatch_rows /= 2;
  }
  const int64_t R = p.row_capacity();
  P.minibatches = static_cast<int>((R + P.minibatch_rows - 1) / P.minibatch_rows);
  const int64_t full = int64_t(P.minibatches) * P.minibatch_rows;  // a ring this big is never reused
  int64_t ring = cfg.ring_rows ? cfg.ring_rows : std::min<int64_t>(R, kDefaultRingRows);
  if (cfg.ring_rows != 0 && ring % P.minibatch_rows != 0)
    return "mok cuda megakernel: ring_rows must be a multiple of minibatch_rows";
  ring = std::min(full, std::max<int64_t>(P.minibatch_rows, ring / P.minibatch_rows * P.minibatch_rows));
  P.ring_rows = static_cast<int>(ring);
  P.counter_bytes = static_cast<size_t>(kHeaderWords + 2 * P.minibatches) * sizeof(int32_t);
  *plan = P;
  return nullptr;
}

const char* launch_megakernel_forward(const Problem& pr, const MegakernelPlan& plan, const MegakernelArgs& a,
                                      int num_sms, cudaStream_t stream) {
  if (pr.tokens <= 0) return nullptr;
  if (a.num_peers < 1 || a.num_peers > kMaxPeers || a.tokens_per_peer <= 0)
    return "mok cuda megakernel: bad peer table";
  if (get_encoder() == nullptr) return "mok cuda megakernel: cuTensorMapEncodeTiled unavailable";
  const int64_t R = pr.row_capacity();
  CUtensorMap tm_ring, tm_wg, tm_wu, tm_act, tm_wd;
  if (!make_map_a(&tm_ring, a.ring, plan.ring_rows, pr.hidden) || !make_map_a(&tm_act, a.act, R, pr.ffn) ||
      !make_map_b(&tm_wg, a.w_gate, pr.experts, pr.hidden, pr.ffn) ||
      !make_map_b(&tm_wu, a.w_up, pr.experts, pr.hidden, pr.ffn) ||
      !make_map_b(&tm_wd, a.w_down, pr.experts, pr.ffn, pr.hidden))
    return "mok cuda megakernel: tensor map encode failed";

  MegaParams p{};
  for (int i = 0; i < a.num_peers; ++i) p.peer_x[i] = static_cast<const uint4*>(a.peer_x[i]);
  p.tokens_per_peer = a.tokens_per_peer;
  p.T = static_cast<int>(pr.tokens);
  p.H = static_cast<int>(pr.hidden);
  p.F = static_cast<int>(pr.ffn);
  p.K = static_cast<int>(pr.top_k);
  p.E = static_cast<int>(pr.experts);
  p.R = static_cast<int>(R);
  p.mb_rows = plan.minibatch_rows;
  p.mb_tiles = plan.minibatch_rows / kBM;
  p.slots = plan.ring_rows / plan.minibatch_rows;
  p.minibatches = plan.minibatches;
  p.nb_gu = static_cast<int>((pr.ffn + 127) / 128);
  p.nb_d = static_cast<int>((pr.hidden + 255) / 256);
  p.kb_gu = static_cast<int>((pr.hidden + kBK - 1) / kBK);
  p.kb_d = static_cast<int>((pr.ffn + kBK - 1) / kBK);
  p.expert_offsets = a.expert_offsets;
  p.tile_expert = a.tile_expert;
  p.row_pair = a.row_pair;
  p.pair_row = a.pair_row;
  p.topk_weights = a.topk_weights;
  p.token_mask = a.token_mask;
  p.ring = static_cast<uint4*>(a.ring);
  p.gate_pre = static_cast<__nv_bfloat16*>(a.gate_pre);
  p.up_pre = static_cast<__nv_bfloat16*>(a.up_pre);
  p.act = static_cast<__nv_bfloat16*>(a.act);
  p.routed_out = static_cast<__nv_bfloat16*>(a.routed_out);
  p.shared_out = static_cast<const uint4*>(a.shared_out);
  p.y = static_cast<uint4*>(a.y);
  p.ctr = a.counters;
  p.flags = a.flags;

  static std::atomic<int> attr_done{0};
  if (attr_done.load() == 0) {
    if (cudaFuncSetAttribute(moe_forward_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) !=
        cudaSuccess)
      return "mok cuda megakernel: cudaFuncSetAttribute failed";
    attr_done.store(1);
  }
  // One CTA per SM (216 KB of shared memory each), all resident together.
  const int grid = std::max(2, num_sms);
  p.dispatch_ctas = std::min(plan.dispatch_ctas, grid - 1);
  // Down tasks of minibatch m are claimed about a wave of tickets after its
  // gate/up tasks, so they rarely wait.
  p.lag = (grid + (p.nb_gu + p.nb_d) * p.mb_tiles - 1) / ((p.nb_gu + p.nb_d) * p.mb_tiles) + 1;
  if (cudaMemsetAsync(a.counters, 0, plan.counter_bytes, stream) != cudaSuccess)
    return "mok cuda megakernel: counter reset failed";
  moe_forward_megakernel<<<grid, kThreads, kSmemBytes, stream>>>(tm_ring, tm_wg, tm_wu, tm_act, tm_wd, p);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda megakernel: launch failed";
  return nullptr;
}

}  // namespace mok::cuda
