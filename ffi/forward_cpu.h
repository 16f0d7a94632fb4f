// The CPU forward: every stage of plan.h in order, one expert segment at a time.
#pragma once

#include <string>

#include "parallel_cpu.h"
#include "plan.h"

namespace mok {

// Returns an empty string or a message naming the bad argument.
std::string forward_cpu(const Problem& prob, const ForwardArgs& args,
                        const ParallelFor& pfor = serial_for);

// The backward: d_x, d_topk_weights and every weight gradient from the
// forward's inputs and residuals (the routed expert outputs are not saved:
// d_topk_weights[p] = <dy[t] @ w_down[e]^T, a[row]>, an exact identity).
std::string backward_cpu(const Problem& prob, const BackwardArgs& args,
                         const ParallelFor& pfor = serial_for);

}  // namespace mok
