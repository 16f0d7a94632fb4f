// Orchestration of the CUDA forward (see forward_cuda.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   flags        int32[4]
//   hist         int32[slots * E]   slots = 8 * ceil(T*K / 4096)
//   counts       int32[E]
//   tile_expert  int32[R / 128]
//   xg / out     bf16[R, H]   gathered x rows; reused for the down output
//   act          bf16[R, F]   silu(gate) * up
//   shared_act   bf16[T, Fs]  (Fs > 0 only)
//   shared_out   bf16[T, H]   (Fs > 0 only)
// Total ~= 2*R*(H + F) + [Fs > 0] * 2*T*(Fs + H) + 4*(slots*E + E + R/128) bytes.
#include "forward_cuda.h"

#include <cuda_runtime.h>

#include "cuda_problem.h"
#include "gemm_wgmma.cuh"

namespace mok::cuda {
namespace {

struct Layout {
  size_t flags, hist, counts, tile_expert, xg, act, shared_act, shared_out, total;
};

Layout make_layout(const Problem& p) {
  Layout L{};
  WorkspaceCarver ws;
  auto take = [&](size_t bytes) { return ws.take(bytes); };
  const size_t R = static_cast<size_t>(p.row_capacity());
  const size_t E = static_cast<size_t>(p.experts);
  L.flags = take(4 * sizeof(int32_t));
  L.hist = take(static_cast<size_t>(detail::schedule_slots(p)) * E * sizeof(int32_t));
  L.counts = take(E * sizeof(int32_t));
  L.tile_expert = take(R / static_cast<size_t>(p.tile_rows) * sizeof(int32_t));
  L.xg = take(R * static_cast<size_t>(p.hidden) * 2);
  L.act = take(R * static_cast<size_t>(p.ffn) * 2);
  if (p.shared_ffn > 0) {
    L.shared_act = take(static_cast<size_t>(p.tokens) * static_cast<size_t>(p.shared_ffn) * 2);
    L.shared_out = take(static_cast<size_t>(p.tokens) * static_cast<size_t>(p.hidden) * 2);
  } else {
    L.shared_act = L.shared_out = 0;
  }
  L.total = ws.total();
  return L;
}

}  // namespace

size_t forward_workspace_bytes(const Problem& problem) {
  if (unsupported_problem(problem) != nullptr) return 0;
  return make_layout(problem).total;
}

size_t forward_workspace_flags_offset(const Problem& problem) { return make_layout(problem).flags; }

const char* forward(const Problem& p, const ForwardArgs& a, void* workspace, cudaStream_t stream,
                    const ForwardStageEvents* ev) {
  if (const char* e = unsupported_problem(p)) return e;
  if (workspace == nullptr || !aligned16(workspace)) return "mok cuda forward: workspace missing or misaligned";
  if (!aligned16(a.x) || !aligned16(a.y) || !aligned16(a.w_gate) || !aligned16(a.w_up) || !aligned16(a.w_down) ||
      !aligned16(a.gate_pre) || !aligned16(a.up_pre))
    return "mok cuda forward: tensors must be 16-byte aligned";
  const bool has_shared = p.shared_ffn > 0;
  if (has_shared && (!aligned16(a.ws_gate) || !aligned16(a.ws_up) || !aligned16(a.ws_down) ||
                     !aligned16(a.shared_gate_pre) || !aligned16(a.shared_up_pre)))
    return "mok cuda forward: shared-expert tensors must be 16-byte aligned";

  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "mok cuda forward: cannot query device";

  const Layout L = make_layout(p);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  int32_t* flags = reinterpret_cast<int32_t*>(ws + L.flags);
  int32_t* hist = reinterpret_cast<int32_t*>(ws + L.hist);
  int32_t* counts = reinterpret_cast<int32_t*>(ws + L.counts);
  int32_t* tile_expert = reinterpret_cast<int32_t*>(ws + L.tile_expert);
  void* xg = ws + L.xg;
  void* act = ws + L.act;
  void* shared_act = has_shared ? static_cast<void*>(ws + L.shared_act) : nullptr;
  void* shared_out = has_shared ? static_cast<void*>(ws + L.shared_out) : nullptr;
  const int64_t R = p.row_capacity();

  auto mark = [&](int i) -> bool { return ev == nullptr || cudaEventRecord(ev->ev[i], stream) == cudaSuccess; };
  if (!mark(0)) return "mok cuda forward: event record failed";

  // 1. schedule
  if (const char* e = detail::launch_schedule(p, a.topk_ids, a.token_mask, a.expert_offsets, a.row_pair, a.pair_row,
                                              hist, counts, tile_expert, flags, stream))
    return e;
  if (!mark(1)) return "mok cuda forward: event record failed";

  // 2. dispatch
  if (const char* e = detail::launch_dispatch(p, a.x, a.row_pair, a.expert_offsets, xg, sms, stream)) return e;
  if (!mark(2)) return "mok cuda forward: event record failed";

  // 3. gate/up + SwiGLU (routed, then shared)
  {
    GroupedGemmArgs g;
    g.a = xg;
    g.m_rows = R;
    g.k = p.hidden;
    g.b0 = a.w_gate;
    g.b1 = a.w_up;
    g.groups = p.experts;
    g.n = p.ffn;
    g.tile_group = tile_expert;
    g.out0 = a.gate_pre;
    g.out1 = a.up_pre;
    g.out2 = act;
    g.zero_unused_tiles = true;
    if (const char* e = launch_grouped_gemm(GemmEpilogue::kGateUpSwiGLU, g, sms, stream)) return e;
  }
  if (has_shared && p.tokens > 0) {
    GroupedGemmArgs g;
    g.a = a.x;
    g.m_rows = p.tokens;
    g.k = p.hidden;
    g.b0 = a.ws_gate;
    g.b1 = a.ws_up;
    g.groups = 1;
    g.n = p.shared_ffn;
    g.row_mask = a.token_mask;
    g.out0 = a.shared_gate_pre;
    g.out1 = a.shared_up_pre;
    g.out2 = shared_act;
    if (const char* e = launch_grouped_gemm(GemmEpilogue::kGateUpSwiGLU, g, sms, stream)) return e;
  }
  if (!mark(3)) return "mok cuda forward: event record failed";

  // 4. down (routed output reuses the xg buffer)
  void* out = xg;
  {
    GroupedGemmArgs g;
    g.a = act;
    g.m_rows = R;
    g.k = p.ffn;
    g.b0 = a.w_down;
    g.groups = p.experts;
    g.n = p.hidden;
    g.tile_group = tile_expert;
    g.out0 = out;
    if (const char* e = launch_grouped_gemm(GemmEpilogue::kStore, g, sms, stream)) return e;
  }
  if (has_shared && p.tokens > 0) {
    GroupedGemmArgs g;
    g.a = shared_act;
    g.m_rows = p.tokens;
    g.k = p.shared_ffn;
    g.b0 = a.ws_down;
    g.groups = 1;
    g.n = p.hidden;
    g.out0 = shared_out;
    if (const char* e = launch_grouped_gemm(GemmEpilogue::kStore, g, sms, stream)) return e;
  }
  if (!mark(4)) return "mok cuda forward: event record failed";

  // 5. combine
  if (const char* e = detail::launch_combine(p, a.token_mask, a.pair_row, a.topk_weights, out, shared_out, a.y, sms,
                                             stream))
    return e;
  if (!mark(5)) return "mok cuda forward: event record failed";
  return nullptr;
}

}  // namespace mok::cuda
