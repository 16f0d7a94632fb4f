// CUDA (Hopper, sm_90a) forward path of mok_jax.
//
//   schedule (schedule.cu, small prepare kernels), then either
//   * staged (the default, MegakernelConfig::persistent = 0): dispatch
//     (dispatch.cu) -> gate/up grouped wgmma GEMM with fused SwiGLU
//     (gemm_wgmma.cu) -> down grouped GEMM -> combine (combine.cu); or
//   * persistent (persistent = 1): one megakernel (megakernel_fwd.cu) with
//     dispatch CTAs filling a ring token buffer, compute CTAs running gate/up
//     (SwiGLU fused) and down tiles in ticket order, and the combine.
//   The shared expert (Fs > 0) runs first as staged GEMMs over all T tokens;
//   both paths give bitwise the same results.
//
// Only DType::kBF16 is supported. All temporaries live in `workspace`
// (forward_workspace_bytes(problem) bytes, 256-byte aligned). No host sync.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "megakernel_fwd.cuh"
#include "plan.h"

namespace mok::cuda {

// Bytes of device scratch `forward` needs for this problem.
size_t forward_workspace_bytes(const Problem& problem, const MegakernelConfig& cfg = {});

// Byte offset (inside the workspace) of an int32 status word that `forward`
// sets on the device: bit 0 = some unmasked token had a top-k id outside
// [0, E) (that pair was treated as not routed). Reading it needs a copy/sync,
// which `forward` never does itself.
size_t forward_workspace_flags_offset(const Problem& problem, const MegakernelConfig& cfg = {});

// Optional per-stage timing (for benchmarks): when non-null, `forward` records
// ev[0] before the schedule, ev[1] after it, ev[2] after the shared expert's
// GEMMs (Fs > 0) and the dispatch, ev[3] after the gate/up GEMM, ev[4] after
// the down GEMM, ev[5] after the combine. With the megakernel, ev[2] is
// recorded before it and ev[3..5] together after it.
struct ForwardStageEvents {
  cudaEvent_t ev[6];
};

// Runs the forward on `stream`. Returns nullptr on success, else a static
// error string.
const char* forward(const Problem& problem, const ForwardArgs& args, void* workspace, cudaStream_t stream,
                    const ForwardStageEvents* stage_events = nullptr, const MegakernelConfig& cfg = {});

namespace detail {
// Stage launchers (internal; see the .cu files).
int64_t schedule_slots(const Problem& pr);
const char* launch_schedule(const Problem& pr, const int32_t* topk_ids, const uint8_t* token_mask,
                            int32_t* expert_offsets, int32_t* row_pair, int32_t* pair_row, int32_t* hist,
                            int32_t* counts, int32_t* tile_expert, int32_t* flags, cudaStream_t stream,
                            int expert_base = 0, int all_experts = 0,  // ids outside [expert_base,
                            // expert_base + pr.experts) of [0, all_experts or pr.experts) are not routed here
                            int32_t* zero_words = nullptr, int64_t zero_count = 0);  // int32s it also zeroes
// x's token rows into the padded expert-major rows xg (dispatch.cu), from the
// schedule: row_pair (rows -> pairs), pair_row (pairs -> rows), expert_offsets.
const char* launch_dispatch(const Problem& pr, const void* x, const int32_t* row_pair, const int32_t* pair_row,
                            const int32_t* expert_offsets, void* xg, int num_sms, cudaStream_t stream);
// The staged forward copies the rows inside its gate/up GEMM (dispatch_fused.cuh)
// instead of launch_dispatch: by default in the forward that keeps no residuals
// (inference) with hidden <= kMaxFusedDispatchHidden, where it measured faster;
// MOK_CUDA_FUSED_DISPATCH=1 fuses it in every staged forward, =0 in none (read
// once per process).
constexpr int64_t kMaxFusedDispatchHidden = 4096;
bool fused_dispatch_enabled(bool keeps_residuals, int64_t hidden);
// Its throttle window in 128-row tiles for rows of `hidden` bf16 elements (at
// least 4): MOK_CUDA_FUSED_DISPATCH_WINDOW_MB of rows ahead of the GEMM's
// front (0 = no throttle), default kDefaultFusedDispatchWindowMB. 8 MB beat no
// throttle and 24 MB at shape 2 (H = 4096: TMA then finds the copied rows in L2)
// and matched no throttle at shape 1 (2026-12-07, H100; docs/design.md).
constexpr int64_t kDefaultFusedDispatchWindowMB = 8;
int fused_dispatch_window_tiles(int64_t hidden);
// The shared expert (no-op when Fs == 0): gate/up + SwiGLU and down GEMMs over all T tokens
// (shared_out nullptr: the pre-activations only, for a backward that recomputes them).
const char* launch_shared_expert(const Problem& p, const void* x, const uint8_t* token_mask, const void* ws_gate,
                                 const void* ws_up, const void* ws_down, void* shared_gate_pre, void* shared_up_pre,
                                 void* shared_act, void* shared_out, int sms, cudaStream_t stream);
const char* launch_combine(const Problem& pr, const uint8_t* token_mask, const int32_t* pair_row,
                           const float* topk_weights, const void* out, const void* shared_out, void* y, int num_sms,
                           cudaStream_t stream);
}  // namespace detail

}  // namespace mok::cuda
