// The persistent forward megakernel (megakernel_fwd.cu): MoK's forward
// structure on Hopper, one launch after the schedule kernels.
//
//   * Every CTA of a one-per-SM persistent grid takes a role when it starts
//     (an atomic counter, so only running CTAs hold roles): the first
//     `dispatch_ctas` become dispatch CTAs, the rest compute CTAs.
//   * Dispatch CTAs claim minibatches (minibatch_rows rows of the padded,
//     expert-major row space) in order and pull each row's token from its
//     owner through a peer-pointer table (one entry at EP = 1) into a
//     fixed-size ring token buffer of ring_rows rows; minibatch m lives in
//     slot m % slots and is written only after every gate/up task of
//     minibatch m - slots is done (macrobatches). A release store of
//     ready[m] hands it over. When no minibatch is left they zero the unused
//     tail of the residuals and join the compute.
//   * Compute CTAs claim tasks from one atomic ticket in a fixed order:
//     phase p = the gate/up tiles of minibatch p, then the down tiles of
//     minibatch p - lag. A gate/up task waits for ready[m]; a down task for
//     all gate/up tasks of its minibatch (gu_done[m]). Every wait points to a
//     lower ticket or to a dispatch CTA whose own waits do, so the schedule
//     cannot deadlock. Tasks are 128 x 256 wgmma tiles (gemm_tile.cuh): the
//     gate/up epilogue fuses SwiGLU, the down epilogue stores bf16 rows.
//   * When no ticket is left, each CTA waits for the last down task and
//     combines tokens (fixed k order, fp32, then the shared expert), so the
//     combine is deterministic and needs no atomics.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "plan.h"

namespace mok::cuda {

// User knobs (mok_jax.MegakernelConfig); 0 = the default.
struct MegakernelConfig {
  int32_t persistent = 0;      // 1: the megakernel; 0: the staged kernels (the default: faster today)
  int32_t dispatch_ctas = 0;   // default kDefaultDispatchCtas
  int32_t minibatch_rows = 0;  // default kDefaultMinibatchRows (halved until it divides ring_rows)
  int32_t ring_rows = 0;       // default min(row capacity, kDefaultRingRows)
};

constexpr int32_t kDefaultDispatchCtas = 16;
// 8 tiles of 128 rows: the gate/up tasks of a minibatch walk its 8 m tiles for
// each weight tile (n-major), so a wave of CTAs shares every weight tile across
// 8 row tiles, as the staged GEMM's rasterisation band. With one tile per
// minibatch, Mixtral's gate/up weights (235 MB per expert) were re-read from
// HBM for every m tile: 13.26 ms against 10.01 ms (H200, standalone harness).
// A default that does not divide a given ring_rows is halved until it does.
constexpr int32_t kDefaultMinibatchRows = 1024;
constexpr int32_t kDefaultRingRows = 32768;
constexpr int kMaxPeers = 8;

// Config resolved against a problem.
struct MegakernelPlan {
  int dispatch_ctas = 0;
  int minibatch_rows = 0;
  int ring_rows = 0;      // a multiple of minibatch_rows
  int minibatches = 0;    // capacity: ceil(R / minibatch_rows)
  size_t counter_bytes = 0;
};

// Validates the knobs; nullptr or a static error string.
const char* resolve_megakernel(const Problem& p, const MegakernelConfig& cfg, MegakernelPlan* plan);

struct MegakernelArgs {
  // Peer-pointer table: token t lives in peer_x[t / tokens_per_peer], row
  // t % tokens_per_peer ([tokens_per_peer, H] each).
  const void* peer_x[kMaxPeers] = {};
  int num_peers = 1;
  int64_t tokens_per_peer = 0;
  const int32_t* expert_offsets = nullptr;  // [E + 1]
  const int32_t* tile_expert = nullptr;     // [R / 128]
  const int32_t* row_pair = nullptr;        // [R]
  const int32_t* pair_row = nullptr;        // [T * K]
  const float* topk_weights = nullptr;      // [T, K]
  const uint8_t* token_mask = nullptr;      // [T]
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* w_down = nullptr;
  void* ring = nullptr;        // [ring_rows, H]
  void* gate_pre = nullptr;    // [R, F]
  void* up_pre = nullptr;      // [R, F]
  void* act = nullptr;         // [R, F]
  void* routed_out = nullptr;  // [R, H]
  const void* shared_out = nullptr;  // [T, H] or nullptr
  void* y = nullptr;           // [T, H]
  int32_t* counters = nullptr;  // plan.counter_bytes, zeroed by the launcher
  int32_t* flags = nullptr;     // bit 1: a wait timed out (the kernel then traps)
};

const char* launch_megakernel_forward(const Problem& p, const MegakernelPlan& plan, const MegakernelArgs& a,
                                      int num_sms, cudaStream_t stream);

}  // namespace mok::cuda
