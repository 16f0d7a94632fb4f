// Expert-parallel backward with in-kernel peer dispatch: the counterpart of
// peer_forward.h (same control blocks, generations, timeout, rounds). The
// forward kept nothing, so each round recomputes its rows' pre-activations.
//
// Per call, on every rank d (stream order):
//   publish / wait / gather   as in the forward, plus dy, topk_weights and the
//             return buffers of d_x rows and partial dots (the routing
//             all-gather also gathers every rank's weights).
//   schedule  count -> pad -> place over all ranks' pairs, d's experts only.
//   shared    the shared expert's forward pre-activations and backward over
//             d's own tokens (backward_cuda.h), while peers pull.
//   rounds    of `round_rows` rows: pull x and dy rows from their owners ->
//             gate/up GEMM (recompute; round 0 uses the forward's kept
//             pre-activations when given, so a balanced load recomputes nothing) -> down dgrad + SwiGLU backward (row
//             weights from the gathered weights; partial dots <gd, a>) ->
//             weight gradients over the round's rows of each expert -> gate +
//             up dgrad, whose epilogue stores every d_x row in its owner's
//             return buffer at the owner's pair index -> push the rows'
//             partial dots there too.
//             With one round the weight gradients go straight to the outputs
//             (bitwise the EP = 1 backward at ranks = 1); with several, each
//             round's bf16 partials of the experts it touches are added into
//             fp32 accumulators (workspace), rounded to bf16 at the end.
//   signal / wait   as in the forward.
//   combine   d_x = sum in k order of the returned rows (+ shared d_x), and
//             d_topk_weights = the returned partial dots summed in order:
//             the EP = 1 combine kernel on the return buffers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "peer_forward.h"
#include "plan.h"

namespace mok::cuda {

struct PeerBackwardArgs {
  const void* dy;             // [T_l, H]
  PeerForwardArgs fwd;        // the forward's inputs (fwd.y unused)
  void* dx;                   // [T_l, H]
  float* d_topk_weights;      // [T_l, K]
  void* dw_gate;              // [E_l, H, F] this rank's experts
  void* dw_up;
  void* dw_down;              // [E_l, F, H]
  void* dws_gate;             // [H, Fs] this rank's tokens' share (summed over ranks by the caller)
  void* dws_up;
  void* dws_down;
  // Optional: round 0's pre-activations kept by the forward (keep_gate /
  // keep_up of PeerForwardArgs, same round_rows): round 0 is not recomputed.
  const void* kept_gate = nullptr;
  const void* kept_up = nullptr;
};

// staged: as peer_forward_workspace_bytes (no return rows or partial dots).
size_t peer_backward_workspace_bytes(const Problem& local, int ranks, int64_t round_rows, bool staged = false);

const char* peer_backward(const Problem& local, const PeerGroup& group, const PeerBackwardArgs& args,
                          void* workspace, int64_t round_rows, cudaStream_t stream);

}  // namespace mok::cuda
