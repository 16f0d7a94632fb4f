// Orchestration of the CUDA forward (see forward_cuda.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   flags        int32[4]
//   hist         int32[slots * E]   slots = 8 * ceil(T*K / 4096)
//   counts       int32[E]
//   tile_expert  int32[R / 128]
//   dispatch_sync int32[2 + R / 128]  the fused dispatch's ticket, front and tile counts
//   staged:      xg / out  bf16[R, H]   gathered x rows; reused for the down output
//   persistent:  ring      bf16[ring_rows, H]   the ring token buffer
//                out       bf16[R, H]           down output (read by the combine)
//                counters  int32[8 + 2 * ceil(R / minibatch_rows)]
//   act          bf16[R, F]   silu(gate) * up
//   shared_act   bf16[T, Fs]  (Fs > 0 only)
//   shared_out   bf16[T, H]   (Fs > 0 only)
#include "forward_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_problem.h"
#include "gemm_wgmma.cuh"

namespace mok::cuda {
namespace {

struct Layout {
  size_t flags, hist, counts, tile_expert, dispatch_sync, xg, ring, counters, act, shared_act, shared_out, total;
  bool persistent;
  MegakernelPlan plan;
};

// The fused dispatch's int32 counters (dispatch_fused.cuh): ticket, front and
// one count per 128-row tile.
int64_t dispatch_sync_words(const Problem& p) { return 2 + p.row_capacity() / p.tile_rows; }

// nullptr or an error (bad knobs).
const char* make_layout(const Problem& p, const MegakernelConfig& cfg, Layout* out) {
  Layout L{};
  L.persistent = cfg.persistent != 0;
  if (L.persistent) {
    if (const char* e = resolve_megakernel(p, cfg, &L.plan)) return e;
  }
  WorkspaceCarver ws;
  auto take = [&](size_t bytes) { return ws.take(bytes); };
  const size_t R = static_cast<size_t>(p.row_capacity());
  const size_t E = static_cast<size_t>(p.experts);
  const size_t H = static_cast<size_t>(p.hidden);
  L.flags = take(4 * sizeof(int32_t));
  L.hist = take(static_cast<size_t>(detail::schedule_slots(p)) * E * sizeof(int32_t));
  L.counts = take(E * sizeof(int32_t));
  L.tile_expert = take(R / static_cast<size_t>(p.tile_rows) * sizeof(int32_t));
  L.dispatch_sync = take(static_cast<size_t>(dispatch_sync_words(p)) * sizeof(int32_t));
  L.xg = take(R * H * 2);
  if (L.persistent) {
    L.ring = take(static_cast<size_t>(L.plan.ring_rows) * H * 2);
    L.counters = take(L.plan.counter_bytes);
  }
  L.act = take(R * static_cast<size_t>(p.ffn) * 2);
  if (p.shared_ffn > 0) {
    L.shared_act = take(static_cast<size_t>(p.tokens) * static_cast<size_t>(p.shared_ffn) * 2);
    L.shared_out = take(static_cast<size_t>(p.tokens) * H * 2);
  }
  L.total = ws.total();
  *out = L;
  return nullptr;
}

}  // namespace

size_t forward_workspace_bytes(const Problem& problem, const MegakernelConfig& cfg) {
  Layout L;
  if (unsupported_problem(problem) != nullptr || make_layout(problem, cfg, &L) != nullptr) return 0;
  return L.total;
}

size_t forward_workspace_flags_offset(const Problem& problem, const MegakernelConfig& cfg) {
  Layout L;
  if (make_layout(problem, cfg, &L) != nullptr) return 0;
  return L.flags;
}

namespace detail {

const char* launch_shared_expert(const Problem& p, const void* x, const uint8_t* token_mask, const void* ws_gate,
                                 const void* ws_up, const void* ws_down, void* shared_gate_pre, void* shared_up_pre,
                                 void* shared_act, void* shared_out, int sms, cudaStream_t stream) {
  if (p.shared_ffn <= 0 || p.tokens <= 0) return nullptr;
  GroupedGemmArgs g;
  g.a = x;
  g.m_rows = p.tokens;
  g.k = p.hidden;
  g.b0 = ws_gate;
  g.b1 = ws_up;
  g.groups = 1;
  g.n = p.shared_ffn;
  g.row_mask = token_mask;
  g.out0 = shared_gate_pre;
  g.out1 = shared_up_pre;
  g.out2 = shared_act;
  if (const char* e = launch_grouped_gemm(GemmEpilogue::kGateUpSwiGLU, g, sms, stream)) return e;
  if (shared_out == nullptr) return nullptr;
  GroupedGemmArgs d;
  d.a = shared_act;
  d.m_rows = p.tokens;
  d.k = p.shared_ffn;
  d.b0 = ws_down;
  d.groups = 1;
  d.n = p.hidden;
  d.out0 = shared_out;
  return launch_grouped_gemm(GemmEpilogue::kStore, d, sms, stream);
}

}  // namespace detail

const char* forward(const Problem& p, const ForwardArgs& a, void* workspace, cudaStream_t stream,
                    const ForwardStageEvents* ev, const MegakernelConfig& cfg) {
  if (const char* e = unsupported_problem(p)) return e;
  Layout L;
  if (const char* e = make_layout(p, cfg, &L)) return e;
  if (workspace == nullptr || !aligned16(workspace)) return "mok cuda forward: workspace missing or misaligned";
  if (!aligned16(a.x) || !aligned16(a.y) || !aligned16(a.w_gate) || !aligned16(a.w_up) || !aligned16(a.w_down) ||
      !aligned16(a.gate_pre) || !aligned16(a.up_pre))
    return "mok cuda forward: tensors must be 16-byte aligned";
  // gate_pre = up_pre = nullptr (and the shared expert's): a forward that keeps
  // no residuals (the handler's check_residuals takes all four or none); the
  // gate/up GEMMs then write the activation only.
  const bool has_shared = p.shared_ffn > 0;
  if (has_shared && (!aligned16(a.ws_gate) || !aligned16(a.ws_up) || !aligned16(a.ws_down) ||
                     !aligned16(a.shared_gate_pre) || !aligned16(a.shared_up_pre)))
    return "mok cuda forward: shared-expert tensors must be 16-byte aligned";

  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "mok cuda forward: cannot query device";

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

  // 1. schedule (its offsets kernel also zeroes the fused dispatch's counters,
  //    which saves the graph a memset node)
  const bool fuse_dispatch = !L.persistent && detail::fused_dispatch_enabled(a.gate_pre != nullptr, p.hidden);
  int32_t* dispatch_sync = reinterpret_cast<int32_t*>(ws + L.dispatch_sync);
  const int64_t sync_words = fuse_dispatch ? dispatch_sync_words(p) : 0;
  if (const char* e = detail::launch_schedule(p, a.topk_ids, a.token_mask, a.expert_offsets, a.row_pair, a.pair_row,
                                              hist, counts, tile_expert, flags, stream, 0, 0, dispatch_sync,
                                              sync_words))
    return e;
  if (!mark(1)) return "mok cuda forward: event record failed";

  // 2. the shared expert (Fs > 0): staged GEMMs over all T tokens
  if (has_shared)
    if (const char* e = detail::launch_shared_expert(p, a.x, a.token_mask, a.ws_gate, a.ws_up, a.ws_down,
                                                     a.shared_gate_pre, a.shared_up_pre, shared_act, shared_out, sms,
                                                     stream))
      return e;
  void* out = xg;  // the routed down output

  if (L.persistent) {
    // 3. the megakernel: dispatch -> gate/up + SwiGLU -> down -> combine
    if (a.gate_pre == nullptr) return "mok cuda forward: the persistent megakernel keeps its residuals";
    MegakernelArgs m;
    m.peer_x[0] = a.x;  // the peer-pointer table of EP = 1
    m.num_peers = 1;
    m.tokens_per_peer = std::max<int64_t>(1, p.tokens);
    m.expert_offsets = a.expert_offsets;
    m.tile_expert = tile_expert;
    m.row_pair = a.row_pair;
    m.pair_row = a.pair_row;
    m.topk_weights = a.topk_weights;
    m.token_mask = a.token_mask;
    m.w_gate = a.w_gate;
    m.w_up = a.w_up;
    m.w_down = a.w_down;
    m.ring = ws + L.ring;
    m.gate_pre = a.gate_pre;
    m.up_pre = a.up_pre;
    m.act = act;
    m.routed_out = out;
    m.shared_out = shared_out;
    m.y = a.y;
    m.counters = reinterpret_cast<int32_t*>(ws + L.counters);
    m.flags = flags;
    if (!mark(2)) return "mok cuda forward: event record failed";
    if (const char* e = launch_megakernel_forward(p, L.plan, m, sms, stream)) return e;
    if (!mark(3) || !mark(4) || !mark(5)) return "mok cuda forward: event record failed";
    return nullptr;
  }

  // 3. dispatch (or, fused, inside the gate/up GEMM: its counters were zeroed in step 1)
  if (!fuse_dispatch)
    if (const char* e = detail::launch_dispatch(p, a.x, a.row_pair, a.pair_row, a.expert_offsets, xg, sms, stream))
      return e;
  if (!mark(2)) return "mok cuda forward: event record failed";

  // 4. gate/up + SwiGLU
  {
    GroupedGemmArgs g;
    if (fuse_dispatch) {
      g.dispatch.x = static_cast<const uint4*>(a.x);
      g.dispatch.row_pair = a.row_pair;
      g.dispatch.total_rows = a.expert_offsets + p.experts;
      g.dispatch.sync = dispatch_sync;
      g.dispatch.flags = flags;
      g.dispatch.top_k = static_cast<int>(p.top_k);
      g.dispatch.window_tiles = detail::fused_dispatch_window_tiles(p.hidden);
    }
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
  if (!mark(3)) return "mok cuda forward: event record failed";

  // 5. down (the routed output reuses the xg buffer)
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
  if (!mark(4)) return "mok cuda forward: event record failed";

  // 6. combine
  if (const char* e = detail::launch_combine(p, a.token_mask, a.pair_row, a.topk_weights, out, shared_out, a.y, sms,
                                             stream))
    return e;
  if (!mark(5)) return "mok cuda forward: event record failed";
  return nullptr;
}

}  // namespace mok::cuda
