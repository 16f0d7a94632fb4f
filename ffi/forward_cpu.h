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

}  // namespace mok
