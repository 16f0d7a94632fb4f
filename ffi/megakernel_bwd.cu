// The persistent backward megakernel (see megakernel_bwd.cuh for the task
// order and the hand-over protocol).
#include "megakernel_bwd.cuh"

#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "bwd_tile.cuh"
#include "megakernel_sync.cuh"

namespace mok::cuda {
namespace {

using namespace bwd;
using namespace sync;
using tile::kBarrierBytes;
using tile::kSmemBytes;
using tile::kStgWarpBytes;
using tile::kThreads;

// Counter words (int32): a header, then dd_done[E] and wd_done[E].
enum Counter : int { kTicket = 0, kFlags = 1, kHeaderWords = 8 };
enum Kind : int { kEnd = -1, kDgradDown = 0, kDgradGateUp = 1, kWgradDown = 2, kWgradGateUp = 3 };
constexpr int kTaskSlots = 2;  // task hand-over ring (producer -> consumers), and back to the signaller

// Only the load maps: the megakernel stores no tile through TMA.
struct LoadMaps {
  CUtensorMap m[6];
};
struct MegaMaps {
  LoadMaps dd, gu, wg;  // dgrad-down (A dys, B w_down), dxs (dg, w_gate, du, w_up), wgrad (3 jobs x A, B)
};

struct MegaParams {
  BParams dd, gu, wg;  // as the staged launches would get them (prepare_*)
  int E;
  int nb_f, nb_h;      // n tiles of the dgrad-down (F / 256) and of the dxs dgrad (H / 256)
  int n_wd, n_wgu;     // wgrad tasks per expert: dW_down; dW_gate + dW_up
  const int32_t* expert_offsets;
  int32_t* ctr;
};

struct Task {
  int kind;
  int e;  // the expert whose counter the task waits on or bumps
  Unit x;
};

__device__ __forceinline__ int expert_tiles(const int32_t* off, int e) { return (off[e + 1] - off[e]) / kBM; }

// Block b of phase 2 starts b * W + (b >= 1 ? off[b - 1] / 128 * nb_h : 0)
// tickets after phase 1 (W = wgrad tasks per expert).
__device__ __forceinline__ int block_start(const MegaParams& p, int b, int w) {
  return b * w + (b >= 1 ? p.expert_offsets[b - 1] / kBM * p.nb_h : 0);
}

// MOK_BWD_MEGAKERNEL_PHASED=1 (measurement only): the staged kernels' order
// inside the megakernel: phase 1, then every expert's wgrad tiles, then every
// dxs tile (each dxs wait then points a whole wgrad phase lower). Against the
// default interleaved order it splits the megakernel's measured loss into the
// cost of mixing wgrad and dxs tiles on the GPU at once (L2 working set) and
// the cost of the megakernel itself (per-task hand-over, the inlined loop's
// spills). Same tiles, same math: the gradients stay bitwise.
// MOK_BWD_MEGAKERNEL_TASK_IN_SMEM=1 (the default since 2026-12-06): consumers
// read the task from its shared slot instead of copying it to registers (see
// the consumer loop): 0 spills against 152 B, 1.3 % faster on an H100 at
// shape 1 (harness 10.97 / 11.00 ms against 11.15 / 11.12, bitwise equal).
// =0 keeps the register copy for comparison.
#ifndef MOK_BWD_MEGAKERNEL_TASK_IN_SMEM
#define MOK_BWD_MEGAKERNEL_TASK_IN_SMEM 1
#endif
#ifndef MOK_BWD_MEGAKERNEL_PHASED
#define MOK_BWD_MEGAKERNEL_PHASED 0
#endif

// Ticket -> task (megakernel_bwd.cuh). Not inlined: the producer thread runs
// it under its 40-register cap.
__device__ __noinline__ Task decode_ticket(const MegaParams& p, int tk, int used_tiles) {
  Task t;
  t.kind = kEnd;
  t.e = 0;
  t.x = Unit{};
  const int n_dd = used_tiles * p.nb_f;
  if (tk < n_dd) {
    t.kind = kDgradDown;
    t.x = dgrad_unit(p.dd, tile::raster(tk, used_tiles, p.nb_f, p.dd.group_m));
    t.e = t.x.grp;
    return t;
  }
  const int v = tk - n_dd;
  const int w = p.n_wd + p.n_wgu;
  if (v >= p.E * w + used_tiles * p.nb_h) return t;
#if MOK_BWD_MEGAKERNEL_PHASED
  // wgrad of expert v / w, or (past E * w) dxs tile u of the expert holding it.
  int b, r;
  const bool wgrad = v < p.E * w;
  if (wgrad) {
    b = v / w;
    r = v % w;
  } else {
    const int u = v - p.E * w;
    int lo = 0, hi = p.E;  // off[lo] / 128 * nb_h <= u < off[hi] / 128 * nb_h
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.expert_offsets[mid] / kBM * p.nb_h <= u) lo = mid;
      else hi = mid;
    }
    b = lo + 1;  // as below: dxs tile r of expert b - 1
    r = u - p.expert_offsets[lo] / kBM * p.nb_h;
  }
#else
  int lo = 0, hi = p.E + 1;  // block_start(lo) <= v < block_start(hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (block_start(p, mid, w) <= v) lo = mid;
    else hi = mid;
  }
  const int b = lo;
  int r = v - block_start(p, b, w);
  const bool wgrad = b < p.E && r < w;
  if (!wgrad && b < p.E) r -= w;
#endif
  if (wgrad) {  // a wgrad task of expert b: dW_down (job 2) first, then dW_gate (0), dW_up (1)
    t.e = b;
    if (r < p.n_wd) {
      t.kind = kWgradDown;
      t.x = decode<kWgrad>(p.wg, p.wg.job[2].unit_begin + b * p.n_wd + r);
    } else {
      r -= p.n_wd;
      const int per = p.n_wgu / 2;
      const int j = r < per ? 0 : 1;
      t.kind = kWgradGateUp;
      t.x = decode<kWgrad>(p.wg, p.wg.job[j].unit_begin + b * per + (r - j * per));
    }
    return t;
  }
  const int e = b - 1;  // a dxs task of expert b - 1, raster order over its row tiles
  tile::TileCoord c = tile::raster(r, expert_tiles(p.expert_offsets, e), p.nb_h, p.gu.group_m);
  c.mt += p.expert_offsets[e] / kBM;
  t.kind = kDgradGateUp;
  t.e = e;
  t.x = dgrad_unit(p.gu, c);
  return t;
}

// A consumer warpgroup's half of one task (bwd_tile.cuh's consume_unit with
// the register epilogues); returns the stage counter. Two builds, A/B on an
// H100 (tests/cuda/gpu_session_bwd_mk.sh, benchmarks/RESULTS.md 2026-12-05):
//   MOK_BWD_MEGAKERNEL_INLINE=1 (default): inlined into the task loop with one
//     shared accumulator (152 bytes of spills; per-variant accumulators
//     spilled 3.8 KB). SASS: 3 WARPGROUP.ARRIVE / 6 DEPBAR for 12 HGMMA, the
//     staged kernels' pipelining. Megakernel 9.65 ms at the Qwen3 shape.
//   MOK_BWD_MEGAKERNEL_INLINE=0: not inlined, so each variant gets the 168
//     registers to itself (0 spills), but ptxas serialises every wgmma at the
//     call boundary (C7510; SASS: one ARRIVE and one DEPBAR per HGMMA):
//     10.73 ms, 11% slower.
#ifndef MOK_BWD_MEGAKERNEL_INLINE
#define MOK_BWD_MEGAKERNEL_INLINE 1
#endif
template <int kMode>
__device__ __forceinline__ uint32_t consume_body(const LoadMaps& maps, const BParams& p, const Unit& x, uint8_t* smem,
                                                 float (&acc)[128], uint32_t it, int cw, int warp, int lane) {
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint8_t* stg = smem + kStages * kStageBytes + kBarrierBytes + (cw * 4 + warp) * kStgWarpBytes;
#if MOK_GEMM_TMA_STORE
  TmaStore tts{stg, lane, 0, {false, false}, 0u};  // unused: register epilogues only
#else
  TmaStore tts;
#endif
  consume_unit<kMode, false>(maps, p, x, acc, smem, full_bar, empty_bar, it, stg, cw, warp, lane, tts);
  return it;
}
#if MOK_BWD_MEGAKERNEL_INLINE
struct Acc {
  float v[128];  // one accumulator for the three inlined variants
};
template <int kMode>
__device__ __forceinline__ uint32_t consume_task(const LoadMaps& maps, const BParams& p, const Unit& x, uint8_t* smem,
                                                 Acc& acc, uint32_t it, int cw, int warp, int lane) {
  return consume_body<kMode>(maps, p, x, smem, acc.v, it, cw, warp, lane);
}
#else
struct Acc {};  // the accumulator lives in the called function
template <int kMode>
__device__ __noinline__ uint32_t consume_task(const LoadMaps& maps, const BParams& p, const Unit x, uint8_t* smem, Acc,
                                              uint32_t it, int cw, int warp, int lane) {
  float acc[128];
  return consume_body<kMode>(maps, p, x, smem, acc, it, cw, warp, lane);
}
#endif

__global__ void __launch_bounds__(kThreads, 1)
    moe_backward_megakernel(const __grid_constant__ MegaMaps maps, const __grid_constant__ MegaParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty_bar = full_bar + kStages;
  uint64_t* task_full = empty_bar + kStages;
  uint64_t* task_empty = task_full + kTaskSlots;
  uint64_t* done_full = task_empty + kTaskSlots;  // finished tasks, consumers -> signaller warp
  uint64_t* done_empty = done_full + kTaskSlots;
  int2* done_info = reinterpret_cast<int2*>(done_empty + kTaskSlots);
  Task* tasks = reinterpret_cast<Task*>(done_info + kTaskSlots);
  static_assert(8 * (2 * kStages + 4 * kTaskSlots) + 8 * kTaskSlots + sizeof(Task) * kTaskSlots <= kBarrierBytes,
                "barrier area");

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&full_bar[s], 1);
      ptx::mbar_init(&empty_bar[s], kConsumerWarps);
    }
    for (int s = 0; s < kTaskSlots; ++s) {
      ptx::mbar_init(&task_full[s], 1);
      ptx::mbar_init(&task_empty[s], 32 * kConsumerWarps);  // every consumer thread
      ptx::mbar_init(&done_full[s], kConsumerWarps);
      ptx::mbar_init(&done_empty[s], 1);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();
  const int used_tiles = p.expert_offsets[p.E] / kBM;  // padded rows in use / 128
  int32_t* dd_done = p.ctr + kHeaderWords;
  int32_t* wd_done = dd_done + p.E;
  int32_t* flags = p.ctr + kFlags;

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------ producer
    ptx::setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      for (int i = 0; i < 2; ++i) ptx::tma_prefetch_desc(&maps.dd.m[i]);
      for (int i = 0; i < 4; ++i) ptx::tma_prefetch_desc(&maps.gu.m[i]);
      for (int i = 0; i < 6; ++i) ptx::tma_prefetch_desc(&maps.wg.m[i]);
      uint32_t it = 0, q = 0;
      // The next ticket is claimed while this one's loads are issued (as in
      // the forward megakernel): the lowest unfinished ticket is always the
      // one its CTA is working on, and its waits point lower still.
      int next = atomicAdd(&p.ctr[kTicket], 1);
      for (;;) {
        const Task t = decode_ticket(p, next, used_tiles);
        if (t.kind != kEnd) next = atomicAdd(&p.ctr[kTicket], 1);
        if (t.kind == kWgradDown || t.kind == kWgradGateUp)
          wait_at_least(&dd_done[t.e], expert_tiles(p.expert_offsets, t.e) * p.nb_f, flags);
        else if (t.kind == kDgradGateUp)
          wait_at_least(&wd_done[t.e], p.n_wd, flags);
        if (t.kind > kDgradDown) fence_proxy_async_global();  // rows other CTAs wrote, read next by TMA
        const uint32_t qs = q % kTaskSlots;
        ptx::mbar_wait(&task_empty[qs], ((q / kTaskSlots) & 1) ^ 1);
        tasks[qs] = t;
        ptx::mbar_arrive(&task_full[qs]);
        ++q;
        if (t.kind == kEnd) break;
        if (t.kind == kDgradDown)
          produce_unit<kSwiGLU>(maps.dd, p.dd, t.x, smem, full_bar, empty_bar, it);
        else if (t.kind == kDgradGateUp)
          produce_unit<kSum2>(maps.gu, p.gu, t.x, smem, full_bar, empty_bar, it);
        else
          produce_unit<kWgrad>(maps.wg, p.wg, t.x, smem, full_bar, empty_bar, it);
      }
    }
    if (threadIdx.x == 32) {
      // Signaller (warp 1): publishes the tasks others wait for, with a
      // gpu-scope fence and a release add, off the consumers' path.
      for (uint32_t n = 0;; ++n) {
        const uint32_t ds = n % kTaskSlots;
        ptx::mbar_wait(&done_full[ds], (n / kTaskSlots) & 1);
        const int2 info = done_info[ds];
        if (info.x < 0) break;
        if (info.x == kDgradDown || info.x == kWgradDown) {
          __threadfence();
          red_release_add(info.x == kDgradDown ? &dd_done[info.y] : &wd_done[info.y], 1);
        }
        ptx::mbar_arrive(&done_empty[ds]);
      }
    }
  } else {
    // ------------------------------------------------------------ consumers
    ptx::setmaxnreg_inc<232>();
    const int cw = wg - 1;
    const int warp = (threadIdx.x / 32) & 3;
    const int lane = threadIdx.x & 31;
    // Task n's end goes to the signaller through done slot n % kTaskSlots:
    // each warp's stores, __syncwarp, then its lane 0 arrives (release);
    // thread 128 also writes what was done (-1: no task left).
    auto hand_over = [&](uint32_t n, int kind, int e) {
      const uint32_t ds = n % kTaskSlots;
      __syncwarp();
      if (lane == 0) {
        ptx::mbar_wait(&done_empty[ds], ((n / kTaskSlots) & 1) ^ 1);
        if (threadIdx.x == 128) done_info[ds] = make_int2(kind, e);
        ptx::mbar_arrive(&done_full[ds]);
      }
      __syncwarp();
    };
    uint32_t it = 0, q = 0;
    Acc acc;
    for (;;) {
      const uint32_t qs = q % kTaskSlots;
      ptx::mbar_wait(&task_full[qs], (q / kTaskSlots) & 1);
#if MOK_BWD_MEGAKERNEL_TASK_IN_SMEM
      // The task stays in its shared slot while it runs (its fields are read
      // where used, not held in registers across the inlined loop); the slot
      // is released at the end, which holds the producer at most one task
      // ahead (it is anyway, but for tasks shorter than the stage ring).
      const Task& t = tasks[qs];
#else
      const Task t = tasks[qs];
      ptx::mbar_arrive(&task_empty[qs]);  // every reader arrives after its own read
#endif
      ++q;
      if (t.kind == kEnd) {
#if MOK_BWD_MEGAKERNEL_TASK_IN_SMEM
        ptx::mbar_arrive(&task_empty[qs]);
#endif
        hand_over(q - 1, -1, 0);
        break;
      }
      if (t.kind == kDgradDown)
        it = consume_task<kSwiGLU>(maps.dd, p.dd, t.x, smem, acc, it, cw, warp, lane);
      else if (t.kind == kDgradGateUp)
        it = consume_task<kSum2>(maps.gu, p.gu, t.x, smem, acc, it, cw, warp, lane);
      else
        it = consume_task<kWgrad>(maps.wg, p.wg, t.x, smem, acc, it, cw, warp, lane);
      const int kind = t.kind, e = t.e;
#if MOK_BWD_MEGAKERNEL_TASK_IN_SMEM
      ptx::mbar_arrive(&task_empty[qs]);  // after this thread's last read of the slot
#endif
      hand_over(q - 1, kind, e);
    }
  }
}

void copy_load_maps(LoadMaps& dst, const Maps& src) { std::memcpy(dst.m, src.m, sizeof(dst.m)); }

}  // namespace

size_t backward_megakernel_counter_bytes(const Problem& p) {
  return static_cast<size_t>(kHeaderWords + 2 * p.experts) * sizeof(int32_t);
}

const char* launch_backward_megakernel(const Problem& pr, const BackwardMegakernelArgs& a, int num_sms,
                                       cudaStream_t stream) {
  // No early return without tokens: the weight gradients still get their zeros.
  const int64_t R = pr.row_capacity(), H = pr.hidden, F = pr.ffn, E = pr.experts;
  MegaMaps maps;
  MegaParams p;
  std::memset(&maps, 0, sizeof(maps));
  std::memset(&p, 0, sizeof(p));
  Maps m;
  bool tma = false;

  DgradArgs dd;  // gd = dys @ w_down[e]^T, SwiGLU backward
  dd.a0 = a.dys;
  dd.m_rows = R;
  dd.k = H;
  dd.b0 = a.w_down;  // [E, F, H] = [groups, n, k]
  dd.groups = E;
  dd.n = F;
  dd.tile_group = a.tile_expert;
  dd.gate_pre = a.gate_pre;
  dd.up_pre = a.up_pre;
  dd.row_pair = a.row_pair;
  dd.pair_weight = a.topk_weights;
  dd.out0 = a.dg;
  dd.out1 = a.du;
  dd.out2 = a.aw;
  dd.part = a.part;
  if (const char* e = prepare_swiglu(dd, false, m, p.dd, tma)) return e;
  copy_load_maps(maps.dd, m);

  DgradArgs gu;  // dxs = dg @ w_gate^T + du @ w_up^T, over the spent dy rows
  gu.a0 = a.dg;
  gu.a1 = a.du;
  gu.m_rows = R;
  gu.k = F;
  gu.b0 = a.w_gate;  // [E, H, F] = [groups, n, k]
  gu.b1 = a.w_up;
  gu.groups = E;
  gu.n = H;
  gu.tile_group = a.tile_expert;
  gu.out0 = a.dys;
  if (const char* e = prepare_sum2(gu, false, m, p.gu, tma)) return e;
  copy_load_maps(maps.gu, m);

  WgradArgs w;  // jobs 0, 1, 2 = dW_gate, dW_up, dW_down (the ticket decode relies on this order)
  w.jobs = 3;
  w.job[0] = WgradJob{a.xs, H, a.dg, F, a.dw_gate};
  w.job[1] = WgradJob{a.xs, H, a.du, F, a.dw_up};
  w.job[2] = WgradJob{a.aw, F, a.dys, H, a.dw_down};
  w.rows = R;
  w.groups = E;
  w.offsets = a.expert_offsets;
  if (const char* e = prepare_wgrad(w, false, m, p.wg, tma)) return e;
  copy_load_maps(maps.wg, m);

  p.E = static_cast<int>(E);
  p.nb_f = p.dd.n_tiles;
  p.nb_h = p.gu.n_tiles;
  p.n_wd = p.wg.job[2].m_tiles * p.wg.job[2].n_tiles;
  p.n_wgu = 2 * p.wg.job[0].m_tiles * p.wg.job[0].n_tiles;
  const int64_t tasks = R / kBM * (p.nb_f + p.nb_h) + E * (p.n_wd + p.n_wgu);
  if (tasks > (int64_t(1) << 30)) return "mok cuda backward megakernel: too many tiles";
  p.expert_offsets = a.expert_offsets;
  p.ctr = a.counters;

  static std::atomic<int> attr_done{0};
  if (attr_done.load() == 0) {
    if (cudaFuncSetAttribute(moe_backward_megakernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) !=
        cudaSuccess)
      return "mok cuda backward megakernel: cudaFuncSetAttribute failed";
    attr_done.store(1);
  }
  if (cudaMemsetAsync(a.counters, 0, backward_megakernel_counter_bytes(pr), stream) != cudaSuccess)
    return "mok cuda backward megakernel: counter reset failed";
  // One CTA per SM (216 KB of shared memory each). Tickets are claimed by
  // running CTAs only, so the schedule holds whatever the residency.
  moe_backward_megakernel<<<std::max(1, num_sms), kThreads, kSmemBytes, stream>>>(maps, p);
  if (cudaGetLastError() != cudaSuccess) return "mok cuda backward megakernel: launch failed";
  return nullptr;
}

}  // namespace mok::cuda
