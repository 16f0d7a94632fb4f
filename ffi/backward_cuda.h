// CUDA (Hopper, sm_90a) backward of mok_jax: the math of backward_cpu.cc.
//
//   prep      : tile_expert from expert_offsets; gather x rows (xs) and dy rows
//               (dys) into the expert-major padded rows (padding rows zero)
//   dgrad-down: gd = dys @ w_down[e]^T with the SwiGLU-backward epilogue:
//               dg, du, a_w = w * a (bf16) and per-256-column partial dots <gd, a>
//   wgrad     : dW_gate[e] = xs_e^T dg_e, dW_up[e] = xs_e^T du_e,
//               dW_down[e] = a_w,e^T dys_e  (one launch; K = the expert's rows;
//               when the row buffers live in the gradient outputs, dW_down
//               here and the other two after combine: backward_cuda.cu)
//   dgrad-gu  : dxs = dg @ w_gate[e]^T + du @ w_up[e]^T (one accumulator, K = 2F)
//   combine   : dx[t] = sum_k dxs[pair_row[t,k]] (+ shared dx), fixed k order;
//               d_topk_weights[p] = sum of the row's partial dots in tile order
// The shared expert (Fs > 0) runs the same GEMMs over the T tokens with weight 1
// (masked tokens: zero dg/du/a rows, so dy/x of masked tokens reach no gradient).
// Every reduction has a fixed order and there are no float atomics: the results
// are bitwise reproducible. Only DType::kBF16. No host sync, no allocation.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "plan.h"

namespace mok::cuda {

// Bytes of device scratch `backward` needs (0 = unsupported problem).
// `megakernel`: the GEMMs run as the persistent backward megakernel
// (megakernel_bwd.cuh) instead of the staged kernels; the layout depends on it,
// so size and run with the same value.
size_t backward_workspace_bytes(const Problem& problem, bool megakernel = false);

// Whether the gathered rows (dys, a_w, dxs, and xs when H <= F) live in the
// weight-gradient outputs rather than the workspace (R (H + F) <= E H F, and
// never with the backward megakernel, whose GEMMs all run at once).
bool backward_rows_in_outputs(const Problem& problem, bool megakernel = false);

// Optional per-stage timing: ev[0] start, ev[1] after prep+gathers, ev[2] after
// the dgrad-down GEMMs, ev[3] after the wgrad GEMMs (only dW_down's when
// backward_rows_in_outputs), ev[4] after the gate/up dgrad GEMMs, ev[5] after
// combine (and the late gate/up wgrads). With the backward megakernel, ev[2] to
// ev[3] is the megakernel (all three GEMM stages) and the others around it are empty.
struct BackwardStageEvents {
  cudaEvent_t ev[6];
};

// Runs the backward on `stream`. Returns nullptr on success, else a static
// error string. `megakernel` as for backward_workspace_bytes (same value).
const char* backward(const Problem& problem, const BackwardArgs& args, void* workspace, cudaStream_t stream,
                     const BackwardStageEvents* stage_events = nullptr, bool megakernel = false);

namespace detail {
// The shared expert's backward over the T tokens (used by `backward` and the
// peer backward): dgrad + SwiGLU backward into d_gate/d_up (which may alias
// the pre-activations), the three weight gradients, and its d_x rows into
// sdx [T, H]; saw [T, Fs] is scratch. Masked tokens reach no gradient.
// No-op when Fs == 0; exact zero dws_* when T == 0.
struct SharedBackwardArgs {
  const void* dy;
  const void* x;
  const uint8_t* token_mask;
  const void *ws_gate, *ws_up, *ws_down;
  const void *gate_pre, *up_pre;
  void *d_gate, *d_up, *saw, *sdx;
  void *dws_gate, *dws_up, *dws_down;
};
const char* launch_shared_backward(const Problem& p, const SharedBackwardArgs& a, int sms, cudaStream_t stream);

// dx[t] = sum in k order of dxs[pair_row[t, k]] (+ sdx[t]), d_topk_weights[t, k]
// = the row's partial dots summed in order; zeros for masked tokens.
const char* launch_combine_bwd(const Problem& p, const uint8_t* token_mask, const int32_t* pair_row, const void* dxs,
                               const void* sdx, const float* part, void* dx, float* d_topk_weights, int sms,
                               cudaStream_t stream);
// ceil(F / 256): partial dots per row.
inline int backward_parts(const Problem& p) { return static_cast<int>((p.ffn + 255) / 256); }
}  // namespace detail

}  // namespace mok::cuda
