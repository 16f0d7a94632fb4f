// The CPU forward: every stage of plan.h in order, one expert segment at a time.
#pragma once

#include <string>
#include <vector>

#include "parallel_cpu.h"
#include "plan.h"

namespace mok {

// Returns an empty string or a message naming the bad argument.
std::string forward_cpu(const Problem& prob, const ForwardArgs& args,
                        const ParallelFor& pfor = serial_for);

// The shared expert: every unmasked token through one dense SwiGLU FFN (its
// pre-activations go to args.shared_gate_pre / shared_up_pre). Returns its
// output rows [T, H] in fp32, empty when Fs == 0. Also used by peer_cpu.cc.
std::vector<float> shared_expert_forward_cpu(const Problem& prob, const ForwardArgs& args);

// The backward: d_x, d_topk_weights and every weight gradient from the
// forward's inputs and residuals (the routed expert outputs are not saved:
// d_topk_weights[p] = <dy[t] @ w_down[e]^T, a[row]>, an exact identity).
std::string backward_cpu(const Problem& prob, const BackwardArgs& args,
                         const ParallelFor& pfor = serial_for);

// Per-segment fp32 work buffers of the CPU backward, reused across experts.
struct SegmentBuffers {
  std::vector<float> xs, dyr, g, u, act, gd, dg, du, dxs, wt;
  void resize(int64_t n, int64_t H, int64_t F) {
    for (auto* v : {&xs, &dyr, &dxs}) v->resize(static_cast<size_t>(n * H));
    for (auto* v : {&g, &u, &act, &gd, &dg, &du}) v->resize(static_cast<size_t>(n * F));
    wt.resize(static_cast<size_t>(H * F));
  }
};

// One dense SwiGLU FFN's backward over n rows (backward_cpu.cc): from its
// input rows b.xs, the saved pre-activations b.g / b.u, the output-gradient
// rows b.dyr and per-row scales (null = 1). Writes d_input rows into b.dxs,
// the weight gradients (fp32, overwritten) and, when `dscale` is given,
// <dyr_i @ wd^T, act_i> per row. Also used by peer_cpu.cc.
void ffn_backward(const Problem& prob, int64_t n, int64_t F, const float* scale, SegmentBuffers& b,
                  const float* wg, const float* wu, const float* wd, float* dwg, float* dwu,
                  float* dwd, float* dscale);

// The shared expert's backward (Fs > 0): writes args.dws_* and returns its
// d_x rows [T, H] in fp32 (empty when Fs == 0). Reads the shared
// pre-activations from args.fwd.
std::vector<float> shared_expert_backward_cpu(const Problem& prob, const BackwardArgs& args);

}  // namespace mok
