// The persistent backward megakernel (megakernel_bwd.cu): every GEMM of the
// routed experts' backward in one launch, between the prep kernels (tile ->
// expert map, x and dy row gathers, the shared expert) and the combine.
//
//   * One CTA per SM; each claims tasks from one atomic ticket. A task is one
//     128 x 256 tile of bwd_tile.cuh, computed with the instructions of the
//     staged kernels (gemm_wgmma_bwd.cu), so the gradients are bitwise theirs.
//   * Ticket order (every wait points to a lower ticket, so the schedule cannot
//     deadlock whatever the residency):
//       1. dgrad-down + SwiGLU backward of every used row tile (tile::raster
//          order): dg, du, w*a and the <gd, a> partials. No waits.
//       2. then blocks b = 0 .. E: [wgrad of expert b: dW_down tiles, then
//          dW_gate and dW_up tiles] [dgrad gate/up (dxs) tiles of expert b - 1].
//     A wgrad task of expert e waits until every dgrad-down task of e's row
//     tiles is done (dd_done[e]); a dxs task of e until every dW_down task of e
//     is done (wd_done[e]), because it writes dxs over e's dy rows, which
//     dW_down reads. Placing e's dxs tasks one block after its wgrads keeps
//     about a block of tickets (over a wave at the benchmark shapes) between a
//     dW_down task and the first dxs task waiting for it.
//   * A finished task is published by a signaller warp (gpu-scope fence, then a
//     release add), as in the forward megakernel; waits acquire, then fence the
//     async proxy before TMA reads the rows. Waits trap after 20 s.
// The epilogues are the register-to-global ones (a TMA store would need its
// bulk-store completion before the release; not built yet).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "plan.h"

namespace mok::cuda {

// Bytes of the megakernel's counters (zeroed by the launcher on every call).
size_t backward_megakernel_counter_bytes(const Problem& p);

struct BackwardMegakernelArgs {
  const int32_t* expert_offsets = nullptr;  // [E + 1], padded segment starts
  const int32_t* tile_expert = nullptr;     // [R / 128]
  const int32_t* row_pair = nullptr;        // [R]
  const float* topk_weights = nullptr;      // [T * K]
  const void* xs = nullptr;       // [R, H] gathered x rows (padding rows zero)
  void* dys = nullptr;            // [R, H] gathered dy rows, then dxs (expert by expert)
  const void* w_gate = nullptr;   // [E, H, F]
  const void* w_up = nullptr;     // [E, H, F]
  const void* w_down = nullptr;   // [E, F, H]
  const void* gate_pre = nullptr;  // [R, F]
  const void* up_pre = nullptr;    // [R, F]
  void* dg = nullptr;             // [R, F] (may alias gate_pre)
  void* du = nullptr;             // [R, F] (may alias up_pre)
  void* aw = nullptr;             // [R, F]
  float* part = nullptr;          // [R, ceil(F / 256)]
  void* dw_gate = nullptr;        // [E, H, F]
  void* dw_up = nullptr;          // [E, H, F]
  void* dw_down = nullptr;        // [E, F, H]
  int32_t* counters = nullptr;    // backward_megakernel_counter_bytes
};

const char* launch_backward_megakernel(const Problem& p, const BackwardMegakernelArgs& a, int num_sms,
                                       cudaStream_t stream);

}  // namespace mok::cuda
