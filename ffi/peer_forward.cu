// Orchestration of the peer-dispatch forward (protocol in peer_forward.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   the shared schedule part (carve_peer_schedule, also the backward's):
//   flags        int32[4]
//   x_table      uint64[8]      every rank's x this call
//   ret_table    uint64[8]      every rank's return buffer this call
//   (dy_table, part_table uint64[8]: backward only)
//   ids_all      int32[ranks * T * K]    the routing all-gather
//   mask_all     uint8[ranks * T]
//   (w_all       fp32[ranks * T * K]: backward only)
//   hist         int32[slots * E_l]      schedule scratch (global pairs)
//   counts       int32[E_l]
//   offsets      int32[E_l + 1]          padded start row of each local expert
//   row_pair     int32[rounds * C]       global pair of each row, -1 = padding
//   pair_row     int32[ranks * T * K]    (schedule output, unused)
//   tile_expert  int32[rounds * C / 128]
//   local_pairs  int32[T * K]            this rank's routed pairs (combine)
//   row_dst      uint64[C]               one round's row destinations (owners' return rows)
//   then the forward's own:
//   xg           bf16[C, H]              one round's pulled rows
//   gate, up     bf16[C, F] each         one round's pre-activations (not kept)
//   act          bf16[C, F]
//   ret          bf16[T * K, H]          this rank's down rows, pushed by their experts' ranks
//   shared_*     gate/up/act [T, Fs], out [T, H]   (Fs > 0 only)
#include "peer_forward.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "backward_cuda.h"
#include "cuda_problem.h"
#include "forward_cuda.h"
#include "gemm_wgmma.cuh"

namespace mok::cuda {
namespace {

struct PeerLayout {
  detail::PeerSchedule s;
  size_t xg, act, ret, s_act, s_out, total;
};

// staged: the return rows live in the rank's IPC staging (several
// processes), so the XLA workspace holds none.
PeerLayout make_peer_layout(const Problem& p, int ranks, int64_t C, bool staged) {
  PeerLayout L{};
  WorkspaceCarver ws;
  L.s = detail::carve_peer_schedule(p, ranks, C, false, ws);
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t H = static_cast<size_t>(p.hidden), F = static_cast<size_t>(p.ffn);
  // No gate/up pre-activations: the forward's gate/up GEMMs write the
  // activation only, except round 0's when the backward keeps them (keep_gate).
  L.xg = ws.take(static_cast<size_t>(C) * H * 2);
  L.act = ws.take(static_cast<size_t>(C) * F * 2);
  if (!staged) L.ret = ws.take(T * K * H * 2);
  if (p.shared_ffn > 0) {
    const size_t Fs = static_cast<size_t>(p.shared_ffn);
    L.s_act = ws.take(T * Fs * 2);
    L.s_out = ws.take(T * H * 2);
  }
  L.total = ws.total();
  return L;
}

// A rank's staging buffer (several processes): every buffer of one call
// that peers read (x, ids, mask, dy, weights) or write (the return rows and
// the backward's partial dots). Each region 256-byte aligned.
struct StagingLayout {
  size_t x, ids, mask, dy, w, ret, part, total;
};

StagingLayout make_staging_layout(const Problem& p) {
  StagingLayout L{};
  WorkspaceCarver ws;
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t H = static_cast<size_t>(p.hidden), parts = static_cast<size_t>(detail::backward_parts(p));
  L.x = ws.take(T * H * 2);
  L.ids = ws.take(T * K * sizeof(int32_t));
  L.mask = ws.take(T);
  L.dy = ws.take(T * H * 2);
  L.w = ws.take(T * K * sizeof(float));
  L.ret = ws.take(T * K * H * 2);
  L.part = ws.take(T * K * parts * sizeof(float));
  L.total = ws.total();
  return L;
}

}  // namespace

size_t peer_staging_bytes(const Problem& local) {
  if (unsupported_problem(local) != nullptr) return 0;
  return make_staging_layout(local).total;
}

namespace detail {

const char* stage_peer_buffers(const Problem& p, const PeerGroup& group, PeerBuffers* mine, cudaStream_t stream) {
  if (group.staging == nullptr) return nullptr;
  const StagingLayout L = make_staging_layout(p);
  if (group.staging_bytes < L.total)
    return "mok peer dispatch: this rank's IPC staging buffer is smaller than the call needs (mok_jax sizes it "
           "when it traces a call; call the layer through mok_jax)";
  uint8_t* st = group.staging;
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t H = static_cast<size_t>(p.hidden);
  // Copied in stream order after this rank's previous call ended (its final
  // wait saw every peer done with the staging) and before the publish.
  auto copy = [&](const void* src, size_t off, size_t bytes) -> const void* {
    if (src == nullptr) return nullptr;
    if (bytes > 0 && cudaMemcpyAsync(st + off, src, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
      return nullptr;
    return st + off;
  };
  PeerBuffers b = *mine;
  b.x = copy(mine->x, L.x, T * H * 2);
  b.ids = static_cast<const int32_t*>(copy(mine->ids, L.ids, T * K * sizeof(int32_t)));
  b.mask = static_cast<const uint8_t*>(copy(mine->mask, L.mask, T));
  b.dy = copy(mine->dy, L.dy, T * H * 2);
  b.w = static_cast<const float*>(copy(mine->w, L.w, T * K * sizeof(float)));
  if ((mine->x && !b.x) || (mine->ids && !b.ids) || (mine->mask && !b.mask) || (mine->dy && !b.dy) ||
      (mine->w && !b.w))
    return "mok peer dispatch: copying the inputs into the IPC staging buffer failed";
  b.ret = st + L.ret;
  // The backward (the one call with dy) also gets its partial-dot returns here.
  if (mine->dy != nullptr) b.ret_part = reinterpret_cast<float*>(st + L.part);
  *mine = b;
  return nullptr;
}

PeerSchedule carve_peer_schedule(const Problem& p, int ranks, int64_t C, bool backward, WorkspaceCarver& ws) {
  const Problem g = peer_gathered_problem(p, ranks);
  PeerSchedule S{};
  S.backward = backward;
  S.rounds = peer_rounds(p, ranks, C);
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t El = static_cast<size_t>(g.experts), R = static_cast<size_t>(ranks);
  const size_t rows = static_cast<size_t>(S.rounds * C);
  const size_t table = kMaxPeerRanks * sizeof(uint64_t);
  S.flags = ws.take(4 * sizeof(int32_t));
  S.x_table = ws.take(table);
  S.ret_table = ws.take(table);
  if (backward) {
    S.dy_table = ws.take(table);
    S.part_table = ws.take(table);
  }
  S.ids_all = ws.take(R * T * K * sizeof(int32_t));
  S.mask_all = ws.take(R * T);
  if (backward) S.w_all = ws.take(R * T * K * sizeof(float));
  S.hist = ws.take(static_cast<size_t>(schedule_slots(g)) * El * sizeof(int32_t));
  S.counts = ws.take(El * sizeof(int32_t));
  S.offsets = ws.take((El + 1) * sizeof(int32_t));
  S.row_pair = ws.take(rows * sizeof(int32_t));
  S.pair_row = ws.take(R * T * K * sizeof(int32_t));
  S.tile_expert = ws.take(rows / 128 * sizeof(int32_t));
  S.local_pairs = ws.take(T * K * sizeof(int32_t));
  S.row_dst = ws.take(static_cast<size_t>(C) * sizeof(uint64_t));
  return S;
}

const char* launch_peer_prologue(const Problem& p, const PeerGroup& group, const PeerBuffers& mine,
                                 const PeerSchedule& S, int64_t C, uint8_t* ws, int* sms, cudaStream_t stream) {
  const int ranks = group.ranks;  // peer_check(p, ranks, C) passed (the caller's layout needs it)
  if (group.rank < 0 || group.rank >= ranks) return "mok peer dispatch: rank outside [0, ranks)";
  for (int s = 0; s < ranks; ++s)
    if (group.ctl[s] == nullptr) return "mok peer dispatch: missing control block";
  if (ws == nullptr || !aligned16(ws)) return "mok peer dispatch: workspace missing or misaligned";
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "mok peer dispatch: cannot query device";
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  auto u64 = [&](size_t off) { return reinterpret_cast<uint64_t*>(ws + off); };
  const Problem g = peer_gathered_problem(p, ranks);
  const int El = static_cast<int>(g.experts);

  if (const char* e = launch_peer_publish(group.ctl[group.rank], mine, stream)) return e;
  if (const char* e = launch_peer_wait_published(group, stream)) return e;
  PeerTables tables;
  tables.x = u64(S.x_table), tables.ret = u64(S.ret_table);
  if (S.backward) {
    tables.dy = u64(S.dy_table), tables.ret_part = u64(S.part_table);
    tables.w_all = reinterpret_cast<float*>(ws + S.w_all);
  }
  if (const char* e = launch_peer_gather_routing(group, p.tokens, static_cast<int>(p.top_k), i32(S.ids_all),
                                                 ws + S.mask_all, tables, stream))
    return e;
  int32_t* tile_expert = i32(S.tile_expert);
  if (const char* e = launch_schedule(g, i32(S.ids_all), ws + S.mask_all, i32(S.offsets), i32(S.row_pair),
                                      i32(S.pair_row), i32(S.hist), i32(S.counts), tile_expert, i32(S.flags), stream,
                                      group.rank * El, static_cast<int>(p.experts)))
    return e;
  const int64_t scheduled_tiles = g.row_tiles(), all_tiles = S.rounds * C / g.tile_rows;
  if (all_tiles > scheduled_tiles &&
      cudaMemsetAsync(tile_expert + scheduled_tiles, 0xff, size_t(all_tiles - scheduled_tiles) * sizeof(int32_t),
                      stream) != cudaSuccess)  // tiles past the schedule's capacity: unused (-1)
    return "mok peer dispatch: memset failed";
  return launch_peer_local_pairs(p, mine.ids, mine.mask, i32(S.local_pairs), stream);
}

const char* launch_round_gate_up(const Problem& p, int El, int64_t C, const void* xg, const void* w_gate,
                                 const void* w_up, const int32_t* tile_group, void* gate, void* up, void* act,
                                 int sms, cudaStream_t stream) {
  GroupedGemmArgs gu;
  gu.a = xg;
  gu.m_rows = C;
  gu.k = p.hidden;
  gu.b0 = w_gate;
  gu.b1 = w_up;
  gu.groups = El;
  gu.n = p.ffn;
  gu.tile_group = tile_group;
  gu.out0 = gate;
  gu.out1 = up;
  gu.out2 = act;
  return launch_grouped_gemm(GemmEpilogue::kGateUpSwiGLU, gu, sms, stream);
}

}  // namespace detail

int64_t peer_default_round_rows(const Problem& local, int ranks) {
  if (ranks <= 0 || local.experts % ranks != 0) return 0;
  Problem one = local;
  one.experts = local.experts / ranks;
  return std::max<int64_t>(one.tile_rows, one.row_capacity());
}

int64_t peer_rounds(const Problem& local, int ranks, int64_t round_rows) {
  if (round_rows <= 0 || ranks <= 0) return 0;
  const int64_t worst = peer_gathered_problem(local, ranks).row_capacity();
  return std::max<int64_t>(1, (worst + round_rows - 1) / round_rows);
}

const char* peer_check(const Problem& local, int ranks, int64_t round_rows) {
  if (const char* e = unsupported_problem(local)) return e;
  if (ranks < 1 || ranks > kMaxPeerRanks) return "mok peer dispatch: ranks must be in [1, 8]";
  if (local.experts % ranks != 0) return "mok peer dispatch: the number of experts must divide by the ranks";
  if (round_rows < local.tile_rows || round_rows % local.tile_rows != 0)
    return "mok peer dispatch: round_rows must be a positive multiple of 128";
  if (const char* e = unsupported_problem(peer_gathered_problem(local, ranks))) return e;
  return nullptr;
}

size_t peer_forward_workspace_bytes(const Problem& local, int ranks, int64_t round_rows, bool staged) {
  if (peer_check(local, ranks, round_rows) != nullptr) return 0;
  return make_peer_layout(local, ranks, round_rows, staged).total;
}

const char* peer_forward(const Problem& p, const PeerGroup& group, const PeerForwardArgs& a, void* workspace,
                         int64_t C, cudaStream_t stream) {
  if (const char* e = peer_check(p, group.ranks, C)) return e;
  if (!aligned16(a.x) || !aligned16(a.y) || !aligned16(a.w_gate) || !aligned16(a.w_up) || !aligned16(a.w_down))
    return "mok peer dispatch: tensors must be 16-byte aligned";
  const bool staged = group.staging != nullptr;
  const PeerLayout L = make_peer_layout(p, group.ranks, C, staged);
  const detail::PeerSchedule& S = L.s;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  auto u64 = [&](size_t off) { return reinterpret_cast<uint64_t*>(ws + off); };
  const int El = static_cast<int>(p.experts / group.ranks);
  const int K = static_cast<int>(p.top_k);
  void* ret = staged ? nullptr : ws + L.ret;  // staged: stage_peer_buffers points it at the staging
  void* xg = ws + L.xg;
  const int32_t* total = i32(S.offsets) + El;  // the padded rows of this rank's experts
  const int32_t* row_pair = i32(S.row_pair);

  // 1-2. publish, wait, gather the routing, schedule every rank's pairs here
  PeerBuffers mine;
  mine.x = a.x, mine.ids = a.topk_ids, mine.mask = a.token_mask, mine.ret = ret;
  if (const char* e = detail::stage_peer_buffers(p, group, &mine, stream)) return e;
  int sms = 0;
  if (const char* e = detail::launch_peer_prologue(p, group, mine, S, C, ws, &sms, stream)) return e;

  // 3. the shared expert over this rank's tokens, while peers may still be pulling
  if (const char* e = detail::launch_shared_expert(p, a.x, a.token_mask, a.ws_gate, a.ws_up, a.ws_down, nullptr,
                                                   nullptr, ws + L.s_act, ws + L.s_out, sms, stream))
    return e;

  // 4. rounds of C rows: pull -> gate/up + SwiGLU -> down, each row stored
  //    straight into its owner's return buffer
  for (int64_t r = 0; r < S.rounds; ++r) {
    const int64_t row0 = r * C;
    const int32_t* tile_group = i32(S.tile_expert) + row0 / p.tile_rows;
    if (const char* e = detail::launch_peer_pull_rows(u64(S.x_table), p.tokens, K, p.hidden, row_pair, total, row0,
                                                      C, xg, sms, stream))
      return e;
    const bool keep = r == 0 && a.keep_gate != nullptr && a.keep_up != nullptr;
    if (const char* e = detail::launch_round_gate_up(p, El, C, xg, a.w_gate, a.w_up, tile_group,
                                                     keep ? a.keep_gate : nullptr, keep ? a.keep_up : nullptr,
                                                     ws + L.act, sms, stream))
      return e;
    if (const char* e = detail::launch_peer_row_destinations(u64(S.ret_table), p.tokens, K, p.hidden, row_pair,
                                                             total, row0, C, u64(S.row_dst), stream))
      return e;
    GroupedGemmArgs dn;
    dn.a = ws + L.act;
    dn.m_rows = C;
    dn.k = p.ffn;
    dn.b0 = a.w_down;
    dn.groups = El;
    dn.n = p.hidden;
    dn.tile_group = tile_group;
    dn.row_dst = u64(S.row_dst);
    if (const char* e = launch_grouped_gemm(GemmEpilogue::kStore, dn, sms, stream)) return e;
  }

  // 5. tell every rank its rows are back, wait for ours, combine locally
  if (const char* e = detail::launch_peer_signal(group, stream)) return e;
  if (const char* e = detail::launch_peer_wait_returns(group, stream)) return e;
  return detail::launch_combine(p, a.token_mask, i32(S.local_pairs), a.topk_weights, mine.ret,
                                p.shared_ffn > 0 ? ws + L.s_out : nullptr, a.y, sms, stream);
}

}  // namespace mok::cuda
