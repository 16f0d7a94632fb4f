// Orchestration of the peer-dispatch backward (protocol in peer_backward.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   the shared schedule part (detail::carve_peer_schedule, with the backward's
//   dy / part tables and the gathered weights w_all; row_dst holds each row's
//   d_x destination), then
//   round_off    int32[E_l + 1]         each expert's rows within the current round
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
  detail::PeerSchedule s;
  size_t round_off, xg, dyg, gate, up, act, part, ret_dx, ret_part, s_gate, s_up, s_act, s_dx, dw_part, dw_acc, total;
};

// staged: the return rows and partial dots live in the rank's IPC staging.
BwdLayout make_layout(const Problem& p, int ranks, int64_t C, bool staged) {
  BwdLayout L{};
  WorkspaceCarver ws;
  L.s = detail::carve_peer_schedule(p, ranks, C, true, ws);
  const size_t T = static_cast<size_t>(p.tokens), K = static_cast<size_t>(p.top_k);
  const size_t H = static_cast<size_t>(p.hidden), F = static_cast<size_t>(p.ffn);
  const size_t El = static_cast<size_t>(p.experts / ranks), Cs = static_cast<size_t>(C);
  const size_t parts = static_cast<size_t>(detail::backward_parts(p));
  L.round_off = ws.take((El + 1) * 4);
  L.xg = ws.take(Cs * H * 2);
  L.dyg = ws.take(Cs * H * 2);
  L.gate = ws.take(Cs * F * 2);
  L.up = ws.take(Cs * F * 2);
  L.act = ws.take(Cs * F * 2);
  L.part = ws.take(Cs * parts * 4);
  if (!staged) {
    L.ret_dx = ws.take(T * K * H * 2);
    L.ret_part = ws.take(T * K * parts * 4);
  }
  if (p.shared_ffn > 0) {
    const size_t Fs = static_cast<size_t>(p.shared_ffn);
    L.s_gate = ws.take(T * Fs * 2);
    L.s_up = ws.take(T * Fs * 2);
    L.s_act = ws.take(T * Fs * 2);
    L.s_dx = ws.take(T * H * 2);
  }
  if (L.s.rounds > 1) {
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

size_t peer_backward_workspace_bytes(const Problem& local, int ranks, int64_t round_rows, bool staged) {
  if (peer_check(local, ranks, round_rows) != nullptr) return 0;
  return make_layout(local, ranks, round_rows, staged).total;
}

const char* peer_backward(const Problem& p, const PeerGroup& group, const PeerBackwardArgs& a, void* workspace,
                          int64_t C, cudaStream_t stream) {
  if (const char* e = peer_check(p, group.ranks, C)) return e;
  const PeerForwardArgs& f = a.fwd;
  for (const void* q : std::initializer_list<const void*>{a.dy, f.x, f.w_gate, f.w_up, f.w_down, a.dx, a.dw_gate, a.dw_up, a.dw_down})
    if (!aligned16(q)) return "mok peer backward: tensors must be 16-byte aligned";
  const bool staged = group.staging != nullptr;
  const BwdLayout L = make_layout(p, group.ranks, C, staged);
  const detail::PeerSchedule& S = L.s;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  auto u64 = [&](size_t off) { return reinterpret_cast<uint64_t*>(ws + off); };
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  const int El = static_cast<int>(p.experts / group.ranks), K = static_cast<int>(p.top_k);
  const int parts = detail::backward_parts(p);
  const int64_t H = p.hidden, F = p.ffn;
  const int32_t* offsets = i32(S.offsets);
  const int32_t* row_pair = i32(S.row_pair);
  const int32_t* total = offsets + El;  // the padded rows of this rank's experts
  int32_t* round_off = i32(L.round_off);
  const bool several = S.rounds > 1;
  const size_t dw_elems = static_cast<size_t>(El) * H * F;

  // 1-2. publish (with dy, the weights and the partial-dot returns), wait,
  //      gather, and the forward's schedule: the same rows in the same order
  PeerBuffers mine;
  // staged: stage_peer_buffers points ret / ret_part at the staging
  mine.x = f.x, mine.ids = f.topk_ids, mine.mask = f.token_mask, mine.ret = staged ? nullptr : ws + L.ret_dx;
  mine.dy = a.dy, mine.w = f.topk_weights, mine.ret_part = staged ? nullptr : f32(L.ret_part);
  if (const char* e = detail::stage_peer_buffers(p, group, &mine, stream)) return e;
  int sms = 0;
  if (const char* e = detail::launch_peer_prologue(p, group, mine, S, C, ws, &sms, stream)) return e;

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
  for (int64_t r = 0; r < S.rounds; ++r) {
    const int64_t row0 = r * C;
    const int32_t* tile_group = i32(S.tile_expert) + row0 / p.tile_rows;
    auto pull = [&](size_t table, void* rows) {  // this round's rows of x or dy, from their owners
      return detail::launch_peer_pull_rows(u64(table), p.tokens, K, H, row_pair, total, row0, C, rows, sms, stream);
    };
    if (const char* e = pull(S.x_table, xg)) return e;
    if (const char* e = pull(S.dy_table, dyg)) return e;
    // recompute the pre-activations, unless the forward kept round 0's
    const bool kept = r == 0 && a.kept_gate != nullptr && a.kept_up != nullptr;
    if (!kept)
      if (const char* e = detail::launch_round_gate_up(p, El, C, xg, f.w_gate, f.w_up, tile_group, ws + L.gate,
                                                       ws + L.up, ws + L.act, sms, stream))
        return e;
    DgradArgs dd;  // gd = dy @ w_down^T, SwiGLU backward, w * a, partial dots
    dd.a0 = dyg;
    dd.m_rows = C;
    dd.k = H;
    dd.b0 = f.w_down;
    dd.groups = El;
    dd.n = F;
    dd.tile_group = tile_group;
    dd.gate_pre = kept ? a.kept_gate : ws + L.gate;
    dd.up_pre = kept ? a.kept_up : ws + L.up;
    dd.row_pair = row_pair + row0;
    dd.pair_weight = f32(S.w_all);
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
    if (const char* e = detail::launch_peer_row_destinations(u64(S.ret_table), p.tokens, K, H, row_pair, total, row0, C,
                                                             u64(S.row_dst), stream))
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
    dx.tile_group = tile_group;
    dx.row_dst = u64(S.row_dst);
    if (const char* e = launch_dgrad_sum2(dx, sms, stream)) return e;
    if (const char* e = detail::launch_peer_push_part(u64(S.part_table), p.tokens, K, parts, row_pair, total, row0, C,
                                                      f32(L.part), sms, stream))
      return e;
  }

  // 5. signal, wait for this rank's rows, combine; the summed weight gradients
  if (const char* e = detail::launch_peer_signal(group, stream)) return e;
  if (const char* e = detail::launch_peer_wait_returns(group, stream)) return e;
  if (const char* e = detail::launch_combine_bwd(p, f.token_mask, i32(S.local_pairs), mine.ret,
                                                 p.shared_ffn > 0 ? ws + L.s_dx : nullptr, mine.ret_part, a.dx,
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
