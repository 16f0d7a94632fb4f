// The peer-dispatch kernels (protocol in peer_forward.h): publish / wait on
// the ranks' control blocks, the routing all-gather, the row pull from the
// owners, where the GEMM epilogues store the results (row destinations), and
// the push of the backward's partial dots.
//
// Flags are 32-bit generation counters compared wrap-safe; release stores and
// adds and acquire loads are at system scope because the peers are other GPUs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "peer_forward.h"

namespace mok::cuda::detail {
namespace {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// a - b as a signed distance: counters only grow, and may wrap.
__device__ __forceinline__ int32_t gen_diff(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b); }

// Copies the control-block pointers into a kernel parameter.
struct Ctl {
  PeerControl* c[kMaxPeerRanks];
  int64_t delta[kMaxPeerRanks];  // PeerGroup::delta
  int rank, ranks;
  uint64_t timeout_ns;
};
Ctl make_ctl(const PeerGroup& g) {
  Ctl c{};
  for (int i = 0; i < kMaxPeerRanks; ++i) c.c[i] = g.ctl[i], c.delta[i] = g.delta[i];
  c.rank = g.rank;
  c.ranks = g.ranks;
  c.timeout_ns = g.timeout_ns;
  return c;
}

__global__ void peer_publish(PeerControl* self, PeerBuffers b) {
  // Only this rank writes its gen, so a plain read sees its own last store.
  const uint32_t g = *reinterpret_cast<volatile uint32_t*>(&self->gen) + 1u;
  self->x = reinterpret_cast<uint64_t>(b.x);
  self->ids = reinterpret_cast<uint64_t>(b.ids);
  self->mask = reinterpret_cast<uint64_t>(b.mask);
  self->ret = reinterpret_cast<uint64_t>(b.ret);
  self->dy = reinterpret_cast<uint64_t>(b.dy);
  self->w = reinterpret_cast<uint64_t>(b.w);
  self->ret_part = reinterpret_cast<uint64_t>(b.ret_part);
  st_release_sys(&self->gen, g);  // orders the pointers (and the caller's inputs) before g
}

// Lane s waits for rank s to publish this call's generation.
__global__ void peer_wait_published(Ctl c) {
  const int s = threadIdx.x;
  if (s >= c.ranks) return;
  const uint32_t g = *reinterpret_cast<volatile uint32_t*>(&c.c[c.rank]->gen);
  const uint64_t t0 = global_ns();
  for (;;) {
    const int32_t d = gen_diff(ld_acquire_sys(&c.c[s]->gen), g);
    if (d == 0) return;
    if (d > 0) {  // a peer cannot pass g before this rank has pushed its rows
      printf("mok peer dispatch: rank %d is at call %u but rank %d already at %u (ranks called a different number "
             "of times)\n", c.rank, g, s, g + d);
      __trap();
    }
    if (global_ns() - t0 > c.timeout_ns) {
      printf("mok peer dispatch: rank %d waited %.1f s for rank %d to enter call %u: lost peer\n", c.rank,
             double(c.timeout_ns) * 1e-9, s, g);
      __trap();
    }
    __nanosleep(256);
  }
}

// Rank s's published address as mapped here (0 stays 0: not published).
__device__ __forceinline__ uint64_t peer_address(const Ctl& c, int s, const uint64_t* field) {
  const uint64_t a = ld_relaxed_sys_u64(field);
  return a == 0 ? 0 : a + static_cast<uint64_t>(c.delta[s]);
}

// ids_all[s*T*K + i] = ids of rank s, mask_all[s*T + t] likewise (and the
// weights, in the backward); the tables get every rank's buffer pointers.
// After peer_wait_published.
__global__ void peer_gather_routing(Ctl c, int64_t T, int K, int32_t* __restrict__ ids_all,
                                    uint8_t* __restrict__ mask_all, PeerTables t) {
  if (blockIdx.x == 0 && threadIdx.x < c.ranks) {
    const PeerControl* b = c.c[threadIdx.x];
    const int s = threadIdx.x;
    t.x[s] = peer_address(c, s, &b->x);
    t.ret[s] = peer_address(c, s, &b->ret);
    if (t.dy) t.dy[s] = peer_address(c, s, &b->dy);
    if (t.ret_part) t.ret_part[s] = peer_address(c, s, &b->ret_part);
  }
  const int64_t P = T * K;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int s = 0; s < c.ranks; ++s) {
    const int32_t* ids = reinterpret_cast<const int32_t*>(peer_address(c, s, &c.c[s]->ids));
    const uint8_t* mask = reinterpret_cast<const uint8_t*>(peer_address(c, s, &c.c[s]->mask));
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < P; i += stride) ids_all[s * P + i] = ids[i];
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < T; i += stride) mask_all[s * T + i] = mask[i];
    if (t.w_all) {
      const float* w = reinterpret_cast<const float*>(peer_address(c, s, &c.c[s]->w));
      for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < P; i += stride) t.w_all[s * P + i] = w[i];
    }
  }
}

// pair_row[p] = p for this rank's routed pairs (the return buffer is indexed
// by pair), -1 for masked tokens and bad ids: what the combine skips.
__global__ void peer_local_pairs(const int32_t* __restrict__ ids, const uint8_t* __restrict__ mask, int64_t P, int K,
                                 int E, int32_t* __restrict__ pair_row) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += int64_t(gridDim.x) * blockDim.x) {
    const int e = ids[p];
    pair_row[p] = (mask[p / K] != 0 && e >= 0 && e < E) ? static_cast<int32_t>(p) : -1;
  }
}

constexpr int kRowThreads = 256;
constexpr int kRowsPerBlock = kRowThreads / 32;

// Where global pair p (over all ranks' pairs) lives: its rank and local pair.
__device__ __forceinline__ void owner_of(int64_t p, int64_t pairs_per_rank, int* rank, int64_t* local) {
  *rank = static_cast<int>(p / pairs_per_rank);
  *local = p - int64_t(*rank) * pairs_per_rank;
}

// xg[r - row0] = x row of row r's token, pulled from its owner (zeros for padding).
__global__ void __launch_bounds__(kRowThreads) peer_pull_rows(const uint64_t* __restrict__ x_table, int64_t T, int K,
                                                              int64_t vec, const int32_t* __restrict__ row_pair,
                                                              const int32_t* __restrict__ total_rows, int64_t row0,
                                                              int64_t rows, uint4* __restrict__ xg) {
  const int64_t end = min(row0 + rows, int64_t(*total_rows));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t r = row0 + int64_t(blockIdx.x) * kRowsPerBlock + warp; r < end; r += int64_t(gridDim.x) * kRowsPerBlock) {
    const int32_t p = row_pair[r];
    uint4* dst = xg + (r - row0) * vec;
    if (p < 0) {
      for (int64_t c = lane; c < vec; c += 32) dst[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    int s;
    int64_t lp;
    owner_of(p, T * K, &s, &lp);
    const uint4* src = reinterpret_cast<const uint4*>(x_table[s]) + (lp / K) * vec;
    int64_t c = lane;
    for (; c + 96 < vec; c += 128) {  // 4 loads in flight per lane (remote latency)
      const uint4 v0 = __ldg(src + c), v1 = __ldg(src + c + 32), v2 = __ldg(src + c + 64), v3 = __ldg(src + c + 96);
      dst[c] = v0;
      dst[c + 32] = v1;
      dst[c + 64] = v2;
      dst[c + 96] = v3;
    }
    for (; c < vec; c += 32) dst[c] = __ldg(src + c);
  }
}

// The address of row r's output in its owner's return rows (bf16, [T*K, H]);
// 0 for padding rows and rows past the schedule.
__global__ void peer_row_destinations(const uint64_t* __restrict__ ret_table, int64_t T, int K, int64_t H,
                                      const int32_t* __restrict__ row_pair, const int32_t* __restrict__ total_rows,
                                      int64_t row0, int64_t rows, uint64_t* __restrict__ row_dst) {
  const int64_t total = *total_rows;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = row0 + i;
    const int32_t p = r < total ? row_pair[r] : -1;
    uint64_t dst = 0;
    if (p >= 0) {
      int s;
      int64_t lp;
      owner_of(p, T * K, &s, &lp);
      dst = ret_table[s] + static_cast<uint64_t>(lp * H) * 2;  // bf16 row
    }
    row_dst[i] = dst;
  }
}

// The owner's partial-dot row of each real row r: ret_part[local pair] = part[r - row0].
__global__ void peer_push_part(const uint64_t* __restrict__ part_table, int64_t T, int K, int parts,
                               const int32_t* __restrict__ row_pair, const int32_t* __restrict__ total_rows,
                               int64_t row0, int64_t rows, const float* __restrict__ part) {
  const int64_t end = min(row0 + rows, int64_t(*total_rows));
  for (int64_t r = row0 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < end;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t p = row_pair[r];
    if (p < 0) continue;
    int s;
    int64_t lp;
    owner_of(p, T * K, &s, &lp);
    float* dst = reinterpret_cast<float*>(part_table[s]) + lp * parts;
    for (int i = 0; i < parts; ++i) dst[i] = part[(r - row0) * parts + i];
  }
}

// Lane s tells rank s that this rank's pushes (earlier kernels) are done.
__global__ void peer_signal(Ctl c) {
  const int s = threadIdx.x;
  if (s >= c.ranks) return;
  __threadfence_system();  // the pushes of the previous kernels, to every GPU, before the add
  red_add_release_sys(&c.c[s]->returns, 1u);
}

__global__ void peer_wait_returns(Ctl c) {
  if (threadIdx.x != 0) return;
  PeerControl* self = c.c[c.rank];
  const uint32_t g = *reinterpret_cast<volatile uint32_t*>(&self->gen);
  const uint32_t target = g * static_cast<uint32_t>(c.ranks);
  const uint64_t t0 = global_ns();
  for (;;) {
    const uint32_t got = ld_acquire_sys(&self->returns);
    if (gen_diff(got, target) >= 0) return;
    if (global_ns() - t0 > c.timeout_ns) {
      printf("mok peer dispatch: rank %d waited %.1f s for its rows back in call %u (%d of %d peers done): lost "
             "peer\n", c.rank, double(c.timeout_ns) * 1e-9, g, int(c.ranks - (target - got)), c.ranks);
      __trap();
    }
    __nanosleep(256);
  }
}

int row_grid(int64_t rows, int num_sms) {
  const int64_t want = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t(num_sms) * 8)));
}

}  // namespace

const char* launch_peer_publish(PeerControl* self, const PeerBuffers& b, cudaStream_t stream) {
  peer_publish<<<1, 1, 0, stream>>>(self, b);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: publish launch failed";
}

const char* launch_peer_wait_published(const PeerGroup& g, cudaStream_t stream) {
  peer_wait_published<<<1, 32, 0, stream>>>(make_ctl(g));
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: wait launch failed";
}

const char* launch_peer_gather_routing(const PeerGroup& g, int64_t tokens, int top_k, int32_t* ids_all,
                                       uint8_t* mask_all, const PeerTables& tables, cudaStream_t stream) {
  const int64_t P = tokens * top_k;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((P + 255) / 256, 264)));
  peer_gather_routing<<<grid, 256, 0, stream>>>(make_ctl(g), tokens, top_k, ids_all, mask_all, tables);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: routing gather launch failed";
}

const char* launch_peer_local_pairs(const Problem& local, const int32_t* ids, const uint8_t* mask, int32_t* pair_row,
                                    cudaStream_t stream) {
  const int64_t P = local.pairs();
  if (P == 0) return nullptr;
  const int grid = static_cast<int>(std::min<int64_t>((P + 255) / 256, 1024));
  peer_local_pairs<<<grid, 256, 0, stream>>>(ids, mask, P, static_cast<int>(local.top_k),
                                             static_cast<int>(local.experts), pair_row);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: local pairs launch failed";
}

const char* launch_peer_pull_rows(const uint64_t* x_table, int64_t tokens_per_rank, int top_k, int64_t hidden,
                                  const int32_t* row_pair, const int32_t* total_rows, int64_t row0, int64_t rows,
                                  void* xg, int num_sms, cudaStream_t stream) {
  peer_pull_rows<<<row_grid(rows, num_sms), kRowThreads, 0, stream>>>(x_table, tokens_per_rank, top_k, hidden / 8,
                                                                      row_pair, total_rows, row0, rows,
                                                                      static_cast<uint4*>(xg));
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: pull launch failed";
}

const char* launch_peer_row_destinations(const uint64_t* ret_table, int64_t tokens_per_rank, int top_k,
                                         int64_t hidden, const int32_t* row_pair, const int32_t* total_rows,
                                         int64_t row0, int64_t rows, uint64_t* row_dst, cudaStream_t stream) {
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + 255) / 256, 1024)));
  peer_row_destinations<<<grid, 256, 0, stream>>>(ret_table, tokens_per_rank, top_k, hidden, row_pair, total_rows,
                                                  row0, rows, row_dst);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: row destinations launch failed";
}

const char* launch_peer_push_part(const uint64_t* part_table, int64_t tokens_per_rank, int top_k, int parts,
                                  const int32_t* row_pair, const int32_t* total_rows, int64_t row0, int64_t rows,
                                  const float* part, int num_sms, cudaStream_t stream) {
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + 255) / 256, int64_t(num_sms) * 4)));
  peer_push_part<<<grid, 256, 0, stream>>>(part_table, tokens_per_rank, top_k, parts, row_pair, total_rows, row0, rows,
                                           part);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: part push launch failed";
}

const char* launch_peer_signal(const PeerGroup& g, cudaStream_t stream) {
  peer_signal<<<1, 32, 0, stream>>>(make_ctl(g));
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: signal launch failed";
}

const char* launch_peer_wait_returns(const PeerGroup& g, cudaStream_t stream) {
  peer_wait_returns<<<1, 32, 0, stream>>>(make_ctl(g));
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok peer dispatch: wait launch failed";
}

}  // namespace mok::cuda::detail
