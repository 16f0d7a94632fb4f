// The "peer" dispatch on CPU devices of one process: the same protocol as
// the CUDA path (peer_forward.h), with host memory as the peer-visible
// memory and a mutex + condition variable per group as the flags.
//
// Per call, on rank r of a group of `ranks` devices (each device's XLA
// program runs on its own host thread, so the ranks meet here):
//   publish   r's slot gets this call's x / ids / mask / return buffer, then
//             gen += 1 (under the group's lock: it orders the pointers).
//   wait      until every slot's gen reached r's (a slot past it: the ranks
//             were called a different number of times; none after the
//             timeout: a lost peer; both are errors naming the ranks).
//   compute   r's experts [r*E_l, (r+1)*E_l) over every rank's pairs, in
//             global pair order, read straight from the owners' x; each
//             expert output row is written into its owner's return buffer
//             (fp32, at the owner's pair index).
//   signal    returns += 1 on every slot; wait until r's returns reached
//             gen * ranks (every peer is done with r's buffers).
//   combine   the fixed-order combine of r's return rows (+ shared expert),
//             the code of forward_cpu: y is bitwise the EP = 1 y.
// The backward (peer_backward_cpu) is the same protocol: each rank pulls x
// and dy rows for its experts, recomputes their pre-activations, writes its
// experts' weight gradients (K over all their rows, in global pair order: the
// EP = 1 gradients) and every d_x row and d_topk_weight into the owner's
// return buffers; the owner combines d_x in k order plus its shared expert's.
// A rank whose own topk_ids are out of range still takes part (its bad pairs
// are skipped) and reports the error after the protocol, so no peer hangs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel_cpu.h"
#include "peer_rank.h"
#include "plan.h"

namespace mok {

struct PeerCpuCall {
  int32_t device = 0;                // this device's ordinal
  std::vector<int32_t> devices;      // every group's devices, rank-major within a group
  int ranks = 1;                     // devices per group
  int64_t timeout_ms = 20000;
};

// `local`: this rank's tokens; experts = the global E (args' w_* hold E/ranks).
std::string peer_forward_cpu(const Problem& local, const PeerCpuCall& call, const ForwardArgs& args,
                             const ParallelFor& pfor = serial_for);
// args.fwd: the forward's inputs (no residuals); shared-expert gradients are
// this rank's tokens' share.
std::string peer_backward_cpu(const Problem& local, const PeerCpuCall& call, const BackwardArgs& args,
                              const ParallelFor& pfor = serial_for);

}  // namespace mok
