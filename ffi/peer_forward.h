// Expert-parallel forward with in-kernel peer dispatch ("peer" mode): the
// GPUs of one host each own E / ranks experts and pull the token rows routed
// to them straight from the owner's memory, then store the down rows back there.
//
// Per call, on every rank d (kernels in peer_dispatch.cu, stream order):
//   publish   d's control block gets this call's x / ids / mask / return
//             buffer pointers, then gen = g (release, system scope).
//   wait      one 32-thread block waits until every rank's gen reached g
//             (acquire; a rank already past g, or none after the timeout,
//             is a protocol error: device printf naming the ranks, then trap).
//   gather    every rank's ids and masks, and its pointers, into d's workspace
//             (the routing all-gather, unicast reads of each peer).
//   schedule  count -> pad -> place (schedule.cu) over all ranks' pairs in
//             rank order, keeping the experts [d*E_l, (d+1)*E_l): the rows of
//             one expert come in global pair order, as at EP = 1.
//   rounds    the padded row space in rounds of `round_rows` rows (a fixed
//             buffer, whatever the imbalance; every round past the last row
//             exits at once): pull the rows' x from their owners -> gate/up
//             GEMM + SwiGLU -> down GEMM, whose epilogue stores each row in
//             its owner's return buffer at the owner's pair index.
//   signal    one release add on every rank's `returns` counter.
//   wait      until d's own `returns` reached g * ranks: every peer has pulled
//             d's rows and stored d's results, so d's buffers may go.
//   combine   the fixed-order combine of the return rows (combine.cu) plus
//             the shared expert, run locally: y is bitwise the EP = 1 y.
//
// Writes into a peer happen only between that peer's publish of g and its
// final wait of g, so no stale data or flags cross calls; counters only grow
// (no reset). The only spinning kernels are single 32-thread blocks, so
// ranks sharing one GPU (the virtual-rank test) cannot starve each other.
// Residuals: optionally round 0's gate/up pre-activations (keep_gate /
// keep_up), for the backward of peer_backward.h, which recomputes the rest.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda_problem.h"
#include "plan.h"

namespace mok::cuda {

constexpr int kMaxPeerRanks = 8;

// One rank's control block, in peer-visible memory owned by the library
// (zeroed once before the first call; never by XLA). The forward and the
// backward (peer_backward.h) share it: each call, of either kind, is one
// generation, and every rank makes the same sequence of calls.
struct alignas(64) PeerControl {
  uint32_t gen;      // this rank's call generation, release-stored after the pointers
  uint32_t returns;  // return signals received: `ranks` per call, monotone
  uint32_t pad[2];
  uint64_t x, ids, mask, ret;  // this call's buffers (valid until its final wait)
  uint64_t dy, w, ret_part;    // the backward's too (0 in the forward)
};

// The buffers a rank publishes for one call.
struct PeerBuffers {
  const void* x = nullptr;
  const int32_t* ids = nullptr;
  const uint8_t* mask = nullptr;
  void* ret = nullptr;       // return rows [T*K, H] (bf16), pushed by the experts' ranks
  const void* dy = nullptr;  // backward: [T, H]
  const float* w = nullptr;  // backward: topk_weights [T, K]
  float* ret_part = nullptr;  // backward: [T*K, ceil(F/256)] partial <gd, a> per pair
};

// Every rank's buffers of this call, gathered into the workspace.
struct PeerTables {
  uint64_t* x = nullptr;         // [8]
  uint64_t* ret = nullptr;       // [8]
  uint64_t* dy = nullptr;        // [8] or nullptr (forward)
  uint64_t* ret_part = nullptr;  // [8] or nullptr
  float* w_all = nullptr;        // [ranks * T * K] or nullptr
};

struct PeerGroup {
  PeerControl* ctl[kMaxPeerRanks] = {};  // every rank's block, addressable from this device
  int rank = 0;
  int ranks = 1;
  uint64_t timeout_ns = 20ull * 1000 * 1000 * 1000;
  // Several processes (CUDA IPC, peer_ipc.h): rank s publishes addresses of
  // its own process; delta[s] turns them into the same memory as mapped in
  // this one (0 for ranks of this process). Every buffer a peer reads or
  // writes then lives in the rank's `staging` (IPC-exported, library-owned),
  // the inputs copied in first. staging == nullptr: one process, the XLA
  // buffers are published as they are.
  int64_t delta[kMaxPeerRanks] = {};
  uint8_t* staging = nullptr;
  size_t staging_bytes = 0;
};

struct PeerForwardArgs {
  const void* x;              // [T_l, H]    this rank's tokens
  const int32_t* topk_ids;    // [T_l, K]    global expert ids in [0, E)
  const float* topk_weights;  // [T_l, K]
  const uint8_t* token_mask;  // [T_l]
  const void* w_gate;         // [E_l, H, F] this rank's experts
  const void* w_up;           // [E_l, H, F]
  const void* w_down;         // [E_l, F, H]
  const void* ws_gate;        // [H, Fs] shared expert (Fs > 0), replicated
  const void* ws_up;
  const void* ws_down;
  void* y;                    // [T_l, H]
  // Optional [round_rows, F] each: round 0's gate/up pre-activations, kept
  // for the backward (which then recomputes rounds >= 1 only). nullptr: not kept.
  void* keep_gate = nullptr;
  void* keep_up = nullptr;
};

// The problem one rank schedules: all ranks' tokens, its own experts.
inline Problem peer_gathered_problem(const Problem& local, int ranks) {
  Problem g = local;
  g.tokens = local.tokens * ranks;
  g.experts = local.experts / ranks;
  return g;
}

// `local`: this rank's slice (tokens = T_l, experts = all E). The round size
// by default is the row capacity of a balanced rank, T_l*K + E_l*127 rounded
// to 128, so a balanced load takes one round.
int64_t peer_default_round_rows(const Problem& local, int ranks);
// nullptr or why (ranks, E % ranks, round_rows).
const char* peer_check(const Problem& local, int ranks, int64_t round_rows);
// staged: the call runs on a PeerGroup with IPC staging (several processes),
// whose return rows are not in the workspace.
size_t peer_forward_workspace_bytes(const Problem& local, int ranks, int64_t round_rows, bool staged = false);
// The staging bytes one rank needs (several processes only): x, ids, mask,
// dy, weights, the return rows and the partial dots of the backward.
size_t peer_staging_bytes(const Problem& local);
// The number of round launches: ceil(worst-case rows / round_rows).
int64_t peer_rounds(const Problem& local, int ranks, int64_t round_rows);

const char* peer_forward(const Problem& local, const PeerGroup& group, const PeerForwardArgs& args,
                         void* workspace, int64_t round_rows, cudaStream_t stream);

namespace detail {
// The workspace regions the forward and the backward share, carved first
// (peer_forward.cu): the buffer tables, the routing all-gather, the schedule
// over every rank's pairs, this rank's pair map and one round's row
// destinations. dy_table, part_table and w_all: the backward's only (0 else).
struct PeerSchedule {
  bool backward;
  size_t flags, x_table, ret_table, dy_table, part_table, ids_all, mask_all, w_all, hist, counts, offsets, row_pair,
      pair_row, tile_expert, local_pairs, row_dst;
  int64_t rounds;
};
PeerSchedule carve_peer_schedule(const Problem& local, int ranks, int64_t round_rows, bool backward,
                                 WorkspaceCarver& ws);
// With group.staging (several processes): copies mine's inputs into the
// staging buffer and points mine (inputs and return buffers) at it; else
// leaves mine as it is.
const char* stage_peer_buffers(const Problem& local, const PeerGroup& group, PeerBuffers* mine, cudaStream_t stream);
// After peer_check: checks the group and the workspace, then in stream order: publish
// `mine` -> wait for every rank -> gather the routing and buffer tables ->
// schedule every rank's pairs onto this rank's experts (tiles past the
// schedule's capacity marked unused) -> this rank's pair map. *sms: the
// device's SM count.
const char* launch_peer_prologue(const Problem& local, const PeerGroup& group, const PeerBuffers& mine,
                                 const PeerSchedule& s, int64_t round_rows, uint8_t* workspace, int* sms,
                                 cudaStream_t stream);
// One round's gate/up GEMM with the SwiGLU epilogue over its pulled rows xg
// [round_rows, H] (this rank's E_l experts, tile_group = the round's tiles).
const char* launch_round_gate_up(const Problem& local, int experts_local, int64_t round_rows, const void* xg,
                                 const void* w_gate, const void* w_up, const int32_t* tile_group, void* gate,
                                 void* up, void* act, int sms, cudaStream_t stream);

// Kernels of peer_dispatch.cu.
const char* launch_peer_publish(PeerControl* self, const PeerBuffers& b, cudaStream_t stream);
const char* launch_peer_wait_published(const PeerGroup& g, cudaStream_t stream);
const char* launch_peer_gather_routing(const PeerGroup& g, int64_t tokens, int top_k, int32_t* ids_all,
                                       uint8_t* mask_all, const PeerTables& tables, cudaStream_t stream);
const char* launch_peer_local_pairs(const Problem& local, const int32_t* ids, const uint8_t* mask,
                                    int32_t* pair_row, cudaStream_t stream);
// Rows [row0, row0 + rows) of the schedule (those below *total_rows).
const char* launch_peer_pull_rows(const uint64_t* x_table, int64_t tokens_per_rank, int top_k, int64_t hidden,
                                  const int32_t* row_pair, const int32_t* total_rows, int64_t row0, int64_t rows,
                                  void* xg, int num_sms, cudaStream_t stream);
// row_dst[i] = the address of row (row0 + i)'s down output in its owner's
// return buffer (0 for padding rows and rows past *total_rows): the down
// GEMM stores each row there directly (GroupedGemmArgs::row_dst), no push.
const char* launch_peer_row_destinations(const uint64_t* ret_table, int64_t tokens_per_rank, int top_k,
                                         int64_t hidden, const int32_t* row_pair, const int32_t* total_rows,
                                         int64_t row0, int64_t rows, uint64_t* row_dst, cudaStream_t stream);
// The fp32 partial dots [rows, parts] of each real row to its owner's
// ret_part at the owner's pair index (the backward's d_topk_weights terms).
const char* launch_peer_push_part(const uint64_t* part_table, int64_t tokens_per_rank, int top_k, int parts,
                                  const int32_t* row_pair, const int32_t* total_rows, int64_t row0, int64_t rows,
                                  const float* part, int num_sms, cudaStream_t stream);
const char* launch_peer_signal(const PeerGroup& g, cudaStream_t stream);
const char* launch_peer_wait_returns(const PeerGroup& g, cudaStream_t stream);
}  // namespace detail

}  // namespace mok::cuda
