// Orchestration of the peer-dispatch backward (protocol in peer_backward.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   flags        int32[4]
//   x/ret/dy/part tables  uint64[8] each
//   ids_all      int32[ranks * T * K],  mask_all uint8[ranks * T],  w_all fp32[ranks * T * K]
//   hist, counts, offsets, row_pair[rounds * C], pair_row, tile_expert   (the schedule, as the forward)
//   local_pairs  int32[T * K]
//   round_off    int32[E_l + 1]         each expert's rows within the current round
//   row_dst      uint64[C]              each row's d_x destination (its owner's return row)
//   xg, dyg      bf16[C, H]             pulled x and dy rows
//   gate, up     bf16[C, F]             recomputed pre-activations, overwritten by dg, du
//   act          bf16[C, F]             the recompute's SwiGLU output, overwritten by w * a
//   part         fp32[C, parts]         partial <gd, a> per row
//   ret_dx       bf16[T * K, H]         this rank's d_x rows, pushed by their experts' ranks
//   ret_part     fp32[T * K, parts]
//   shared       gate/up [T, Fs] (then their gradients), act/saw [T, Fs], sdx [T, H]   (Fs > 0)
//   dw_part      bf16 3 x [E_l, H, F]   one round's weight gradients  } several rounds only
//   dw_acc       fp32 3 x [E_l, H, F]   their sums over the rounds    }
#include "peer_backward.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>

#include "backward_cuda.h"
#include "cuda_problem.h"
#include "forward_cuda.h"
#include "gemm_wgmma.cuh"

namespace mok::cuda {
namespace {

struct BwdLayout {
  size_t flags, x_t, ret_t, dy_t, part_t, ids_all, mask_all, w_all, hist, counts, offsets, row_pair, pair_row,
      tile_expert, local_pairs, round_off, row_dst, xg, dyg, gate, up, act, part, ret_dx, ret_part, s_gate, s_up, s_act, s_dx,
      dw_part, dw_acc, total;
  int64_t rounds;
};

BwdLayout make_layout(const Problem& p, int ranks, int64_t C) {
  const Problem g = peer_gathered_problem(p, ranks);
  BwdLayout L{};
  L.rounds = peer_rounds(p, ranks, C);
  WorkspaceCarver ws;
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t H = static_cast<size_t>(p.hidden), F = static_cast<size_t>(p.ffn);
  const size_t El = static_cast<size_t>(g.experts), R = static_cast<size_t>(ranks);
  const size_t rows = static_cast<size_t>(L.rounds * C), Cs = static_cast<size_t>(C);
  const size_t parts = static_cast<size_t>(detail::backward_parts(p));
  L.flags = ws.take(4 * sizeof(int32_t));
  L.x_t = ws.take(kMaxPeerRanks * 8);
  L.ret_t = ws.take(kMaxPeerRanks * 8);
  L.dy_t = ws.take(kMaxPeerRanks * 8);
  L.part_t = ws.take(kMaxPeerRanks * 8);
  L.ids_all = ws.take(R * T * K * 4);
  L.mask_all = ws.take(R * T);
  L.w_all = ws.take(R * T * K * 4);
  L.hist = ws.take(static_cast<size_t>(detail::schedule_slots(g)) * El * 4);
  L.counts = ws.take(El * 4);
  L.offsets = ws.take((El + 1) * 4);
  L.row_pair = ws.take(rows * 4);
  L.pair_row = ws.take(R * T * K * 4);
  L.tile_expert = ws.take(rows / 128 * 4);
  L.local_pairs = ws.take(T * K * 4);
  L.round_off = ws.take((El + 1) * 4);
  L.row_dst = ws.take(Cs * 8);
  L.xg = ws.take(Cs * H * 2);
  L.dyg = ws.take(Cs * H * 2);
  L.gate = ws.take(Cs * F * 2);
  L.up = ws.take(Cs * F * 2);
  L.act = ws.take(Cs * F * 2);
  L.part = ws.take(Cs * parts * 4);
  L.ret_dx = ws.take(T * K * H * 2);
  L.ret_part = ws.take(T * K * parts * 4);
  if (p.shared_ffn > 0) {
    const size_t Fs = static_cast<size_t>(p.shared_ffn);
    L.s_gate = ws.take(T * Fs * 2);
    L.s_up = ws.take(T * Fs * 2);
    L.s_act = ws.take(T * Fs * 2);
    L.s_dx = ws.take(T * H * 2);
  }
  if (L.rounds > 1) {
    L.dw_part = ws.take(3 * El * H * F * 2);
    L.dw_acc = ws.take(3 * El * H * F * 4);
  }
  L.total = ws.total();
  return L;
}

// round_off[e] = expert e's first row within rows [row0, row0 + C), clamped.
__global__ void round_offsets(const int32_t* __restrict__ offsets, int E, int64_t row0, int64_t C,
                              int32_t* __restrict__ round_off) {
  for (int e = threadIdx.x; e <= E; e += blockDim.x)
    round_off[e] = static_cast<int32_t>(min(max(int64_t(offsets[e]) - row0, int64_t(0)), C));
}

// acc[j] += part[j] over the experts with rows in this round (the others'
// partials are the wgrad's exact zeros: skipped, so an expert's sum only
// holds the rounds it was in). 8 elements per thread.
__global__ void accumulate_rounds(const uint4* __restrict__ part, float4* __restrict__ acc,
                                  const int32_t* __restrict__ round_off, int64_t per_expert8, int E) {
  const int64_t n8 = 3 * int64_t(E) * per_expert8;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>((i / per_expert8) % E);
    if (round_off[e + 1] <= round_off[e]) continue;
    const uint4 v = part[i];
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
    float4 a0 = acc[2 * i], a1 = acc[2 * i + 1];
    float2 f0 = __bfloat1622float2(b[0]), f1 = __bfloat1622float2(b[1]), f2 = __bfloat1622float2(b[2]),
           f3 = __bfloat1622float2(b[3]);
    a0.x += f0.x, a0.y += f0.y, a0.z += f1.x, a0.w += f1.y;
    a1.x += f2.x, a1.y += f2.y, a1.z += f3.x, a1.w += f3.y;
    acc[2 * i] = a0;
    acc[2 * i + 1] = a1;
  }
}

// out_j = bf16(acc_j) for the three gradients.
__global__ void finalize_rounds(const float4* __restrict__ acc, int64_t n8_each, uint4* __restrict__ g,
                                uint4* __restrict__ u, uint4* __restrict__ d) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < 3 * n8_each;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a0 = acc[2 * i], a1 = acc[2 * i + 1];
    uint4 v;
    __nv_bfloat162* b = reinterpret_cast<__nv_bfloat162*>(&v);
    b[0] = __floats2bfloat162_rn(a0.x, a0.y);
    b[1] = __floats2bfloat162_rn(a0.z, a0.w);
    b[2] = __floats2bfloat162_rn(a1.x, a1.y);
    b[3] = __floats2bfloat162_rn(a1.z, a1.w);
    const int64_t j = i / n8_each, k = i - j * n8_each;
    (j == 0 ? g : (j == 1 ? u : d))[k] = v;
  }
}

int elementwise_grid(int64_t n, int sms) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, int64_t(sms) * 8)));
}

}  // namespace

size_t peer_backward_workspace_bytes(const Problem& local, int ranks, int64_t round_rows) {
  if (peer_check(local, ranks, round_rows) != nullptr) return 0;
  return make_layout(local, ranks, round_rows).total;
}

const char* peer_backward(const Problem& p, const PeerGroup& group, const PeerBackwardArgs& a, void* workspace,
                          int64_t C, cudaStream_t stream) {
  const int ranks = group.ranks;
  if (const char* e = peer_check(p, ranks, C)) return e;
  if (group.rank < 0 || group.rank >= ranks) return "mok peer backward: rank outside [0, ranks)";
  for (int s = 0; s < ranks; ++s)
    if (group.ctl[s] == nullptr) return "mok peer backward: missing control block";
  const PeerForwardArgs& f = a.fwd;
  if (workspace == nullptr || !aligned16(workspace)) return "mok peer backward: workspace missing or misaligned";
  for (const void* q : std::initializer_list<const void*>{a.dy, f.x, f.w_gate, f.w_up, f.w_down, a.dx, a.dw_gate, a.dw_up, a.dw_down})
    if (!aligned16(q)) return "mok peer backward: tensors must be 16-byte aligned";
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "mok peer backward: cannot query device";

  const Problem g = peer_gathered_problem(p, ranks);
  const BwdLayout L = make_layout(p, ranks, C);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  auto u64 = [&](size_t off) { return reinterpret_cast<uint64_t*>(ws + off); };
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  const int El = static_cast<int>(g.experts), K = static_cast<int>(p.top_k), parts = detail::backward_parts(p);
  const int64_t H = p.hidden, F = p.ffn;
  int32_t* offsets = i32(L.offsets);
  int32_t* row_pair = i32(L.row_pair);
  int32_t* tile_expert = i32(L.tile_expert);
  int32_t* round_off = i32(L.round_off);
  const bool several = L.rounds > 1;
  const size_t dw_elems = static_cast<size_t>(El) * H * F;

  // 1. publish, wait, gather routing + weights + every rank's buffers
  PeerBuffers mine;
  mine.x = f.x, mine.ids = f.topk_ids, mine.mask = f.token_mask, mine.ret = ws + L.ret_dx;
  mine.dy = a.dy, mine.w = f.topk_weights, mine.ret_part = f32(L.ret_part);
  if (const char* e = detail::launch_peer_publish(group.ctl[group.rank], mine, stream)) return e;
  if (const char* e = detail::launch_peer_wait_published(group, stream)) return e;
  PeerTables tables;
  tables.x = u64(L.x_t), tables.ret = u64(L.ret_t), tables.dy = u64(L.dy_t), tables.ret_part = u64(L.part_t);
  tables.w_all = f32(L.w_all);
  if (const char* e = detail::launch_peer_gather_routing(group, p.tokens, K, i32(L.ids_all), ws + L.mask_all, tables,
                                                         stream))
    return e;

  // 2. the schedule (the forward's: the same rows in the same order)
  if (const char* e = detail::launch_schedule(g, i32(L.ids_all), ws + L.mask_all, offsets, row_pair, i32(L.pair_row),
                                              i32(L.hist), i32(L.counts), tile_expert, i32(L.flags), stream,
                                              group.rank * El, static_cast<int>(p.experts)))
    return e;
  const int64_t scheduled_tiles = g.row_tiles(), all_tiles = L.rounds * C / g.tile_rows;
  if (all_tiles > scheduled_tiles &&
      cudaMemsetAsync(tile_expert + scheduled_tiles, 0xff, size_t(all_tiles - scheduled_tiles) * sizeof(int32_t),
                      stream) != cudaSuccess)
    return "mok peer backward: memset failed";
  if (const char* e = detail::launch_peer_local_pairs(p, f.topk_ids, f.token_mask, i32(L.local_pairs), stream))
    return e;

  // 3. the shared expert over this rank's tokens (recompute, then backward)
  if (p.shared_ffn > 0) {
    if (const char* e = detail::launch_shared_expert(p, f.x, f.token_mask, f.ws_gate, f.ws_up, f.ws_down,
                                                     ws + L.s_gate, ws + L.s_up, ws + L.s_act, nullptr, sms, stream))
      return e;
    detail::SharedBackwardArgs sb{a.dy,         f.x,          f.token_mask, f.ws_gate,    f.ws_up,
                                  f.ws_down,    ws + L.s_gate, ws + L.s_up, ws + L.s_gate, ws + L.s_up,
                                  ws + L.s_act, ws + L.s_dx,  a.dws_gate,   a.dws_up,     a.dws_down};
    if (const char* e = detail::launch_shared_backward(p, sb, sms, stream)) return e;
  }
  if (several && cudaMemsetAsync(ws + L.dw_acc, 0, 3 * dw_elems * 4, stream) != cudaSuccess)
    return "mok peer backward: memset failed";

  // 4. rounds
  void* xg = ws + L.xg;
  void* dyg = ws + L.dyg;
  void* dg = ws + L.gate;  // the dgrad epilogue reads each pre-activation before overwriting it
  void* du = ws + L.up;
  void* aw = ws + L.act;
  uint8_t* dw_part = ws + L.dw_part;
  void* dwg = several ? static_cast<void*>(dw_part) : a.dw_gate;
  void* dwu = several ? static_cast<void*>(dw_part + dw_elems * 2) : a.dw_up;
  void* dwd = several ? static_cast<void*>(dw_part + 2 * dw_elems * 2) : a.dw_down;
  for (int64_t r = 0; r < L.rounds; ++r) {
    const int64_t row0 = r * C;
    const int32_t* total = offsets + El;
    if (const char* e = detail::launch_peer_pull_rows(u64(L.x_t), p.tokens, K, H, row_pair, total, row0, C, xg, sms,
                                                      stream))
      return e;
    if (const char* e = detail::launch_peer_pull_rows(u64(L.dy_t), p.tokens, K, H, row_pair, total, row0, C, dyg,
                                                      sms, stream))
      return e;
    const bool kept = r == 0 && a.kept_gate != nullptr && a.kept_up != nullptr;
    GroupedGemmArgs gu;  // recompute the pre-activations (unless the forward kept them)
    gu.a = xg;
    gu.m_rows = C;
    gu.k = H;
    gu.b0 = f.w_gate;
    gu.b1 = f.w_up;
    gu.groups = El;
    gu.n = F;
    gu.tile_group = tile_expert + row0 / g.tile_rows;
    gu.out0 = ws + L.gate;
    gu.out1 = ws + L.up;
    gu.out2 = ws + L.act;
    if (!kept)
      if (const char* e = launch_grouped_gemm(GemmEpilogue::kGateUpSwiGLU, gu, sms, stream)) return e;
    DgradArgs dd;  // gd = dy @ w_down^T, SwiGLU backward, w * a, partial dots
    dd.a0 = dyg;
    dd.m_rows = C;
    dd.k = H;
    dd.b0 = f.w_down;
    dd.groups = El;
    dd.n = F;
    dd.tile_group = gu.tile_group;
    dd.gate_pre = kept ? a.kept_gate : ws + L.gate;
    dd.up_pre = kept ? a.kept_up : ws + L.up;
    dd.row_pair = row_pair + row0;
    dd.pair_weight = f32(L.w_all);
    dd.out0 = dg;
    dd.out1 = du;
    dd.out2 = aw;
    dd.part = f32(L.part);
    if (const char* e = launch_dgrad_swiglu_bwd(dd, sms, stream)) return e;
    round_offsets<<<1, 256, 0, stream>>>(offsets, El, row0, C, round_off);
    if (cudaGetLastError() != cudaSuccess) return "mok peer backward: round offsets launch failed";
    WgradArgs w;  // K = the expert's rows of this round (128-aligned: C and the segments are)
    w.job[0] = WgradJob{xg, H, dg, F, dwg};
    w.job[1] = WgradJob{xg, H, du, F, dwu};
    w.job[2] = WgradJob{aw, F, dyg, H, dwd};
    w.jobs = 3;
    w.rows = C;
    w.groups = El;
    w.offsets = round_off;
    if (const char* e = launch_wgrad(w, sms, stream)) return e;
    if (several) {
      const int64_t per8 = H * F / 8;
      accumulate_rounds<<<elementwise_grid(3 * El * per8, sms), 256, 0, stream>>>(
          reinterpret_cast<const uint4*>(dw_part), reinterpret_cast<float4*>(ws + L.dw_acc), round_off, per8, El);
      if (cudaGetLastError() != cudaSuccess) return "mok peer backward: accumulate launch failed";
    }
    // d_x rows = dg @ w_gate^T + du @ w_up^T, each stored straight into its
    // owner's return rows
    if (const char* e = detail::launch_peer_row_destinations(u64(L.ret_t), p.tokens, K, H, row_pair, total, row0, C,
                                                             u64(L.row_dst), stream))
      return e;
    DgradArgs dx;
    dx.a0 = dg;
    dx.a1 = du;
    dx.m_rows = C;
    dx.k = F;
    dx.b0 = f.w_gate;
    dx.b1 = f.w_up;
    dx.groups = El;
    dx.n = H;
    dx.tile_group = gu.tile_group;
    dx.row_dst = u64(L.row_dst);
    if (const char* e = launch_dgrad_sum2(dx, sms, stream)) return e;
    if (const char* e = detail::launch_peer_push_part(u64(L.part_t), p.tokens, K, parts, row_pair, total, row0, C,
                                                      f32(L.part), sms, stream))
      return e;
  }

  // 5. signal, wait for this rank's rows, combine; the summed weight gradients
  if (const char* e = detail::launch_peer_signal(group, stream)) return e;
  if (const char* e = detail::launch_peer_wait_returns(group, stream)) return e;
  if (const char* e = detail::launch_combine_bwd(p, f.token_mask, i32(L.local_pairs), ws + L.ret_dx,
                                                 p.shared_ffn > 0 ? ws + L.s_dx : nullptr, f32(L.ret_part), a.dx,
                                                 a.d_topk_weights, sms, stream))
    return e;
  if (several) {
    const int64_t n8 = static_cast<int64_t>(dw_elems / 8);
    finalize_rounds<<<elementwise_grid(3 * n8, sms), 256, 0, stream>>>(
        reinterpret_cast<const float4*>(ws + L.dw_acc), n8, static_cast<uint4*>(a.dw_gate),
        static_cast<uint4*>(a.dw_up), static_cast<uint4*>(a.dw_down));
    if (cudaGetLastError() != cudaSuccess) return "mok peer backward: finalize launch failed";
  }
  return nullptr;
}

}  // namespace mok::cuda
