// The problem and plan shared by every backend (CPU and CUDA).
//
// Both backends compute the same stages over the same data layout, so the
// residuals one backend's forward saves can be read by either backward:
//   schedule  (count -> pad -> place, no sort)  -> expert-major padded rows
//   dispatch  (gather token rows into those rows)
//   gemm      (gate/up projections per expert segment)
//   swiglu    (silu(gate) * up, fused into the gate/up epilogue on CUDA)
//   gemm      (down projection per expert segment)
//   combine   (fixed-order weighted sum over k, plus the shared expert)
#pragma once

#include <cstdint>

namespace mok {

// Every expert segment is padded to a multiple of this many rows: the M tile
// of the CUDA GEMMs. The CPU backend uses the same value so that residual
// shapes (and the schedule tensors) are identical across backends.
constexpr int64_t kTileRows = 128;

enum class DType : int32_t { kF32 = 0, kBF16 = 1 };

struct Problem {
  int64_t tokens = 0;      // T (leading dims already flattened)
  int64_t hidden = 0;      // H
  int64_t ffn = 0;         // F, per routed expert
  int64_t experts = 0;     // E
  int64_t top_k = 0;       // K
  int64_t shared_ffn = 0;  // Fs, 0 when there is no shared expert
  int64_t tile_rows = kTileRows;
  DType dtype = DType::kF32;

  int64_t pairs() const { return tokens * top_k; }
  // Upper bound of sum_e round_up(count_e, tile): every expert wastes at most
  // tile-1 rows of padding. Static, so XLA can allocate the residuals.
  int64_t row_capacity() const {
    const int64_t rows = pairs() + experts * (tile_rows - 1);
    return (rows + tile_rows - 1) / tile_rows * tile_rows;
  }
  int64_t row_tiles() const { return row_capacity() / tile_rows; }
};

// Raw pointers of one forward call. Element types of x / weights / outputs /
// residual activations are `Problem::dtype`; routing tensors are fixed.
struct ForwardArgs {
  const void* x;               // [T, H]
  const int32_t* topk_ids;     // [T, K]
  const float* topk_weights;   // [T, K]
  const uint8_t* token_mask;   // [T], 1 = real token, 0 = padding (not routed)
  const void* w_gate;          // [E, H, F]
  const void* w_up;            // [E, H, F]
  const void* w_down;          // [E, F, H]
  const void* ws_gate;         // [H, Fs]
  const void* ws_up;           // [H, Fs]
  const void* ws_down;         // [Fs, H]
  // outputs
  void* y;                     // [T, H]
  int32_t* expert_offsets;     // [E + 1] padded start row of each segment
  int32_t* row_pair;           // [R] pair index t*K+k of each row, -1 = pad
  int32_t* pair_row;           // [T*K] row of each pair, -1 = not routed
  void* gate_pre;              // [R, F] x_row @ w_gate (residual)
  void* up_pre;                // [R, F] x_row @ w_up   (residual)
  void* shared_gate_pre;       // [T, Fs]
  void* shared_up_pre;         // [T, Fs]
};

// Raw pointers of one backward call (inputs: the forward's inputs and
// residuals; outputs: one cotangent per differentiable input).
struct BackwardArgs {
  const void* dy;              // [T, H]
  ForwardArgs fwd;             // inputs + residuals (its outputs are read-only here)
  void* dx;                    // [T, H]
  float* d_topk_weights;       // [T, K]
  void* dw_gate;               // [E, H, F]
  void* dw_up;                 // [E, H, F]
  void* dw_down;               // [E, F, H]
  void* dws_gate;              // [H, Fs]
  void* dws_up;                // [H, Fs]
  void* dws_down;              // [Fs, H]
  // Scratch of the CUDA backward for the gate/up gradient rows. The FFI call
  // aliases them with the spent residuals (fwd.gate_pre, fwd.up_pre,
  // fwd.shared_*_pre: input_output_aliases), which the backward overwrites
  // in place, so no second [R, F] pair is held. nullptr on the CPU path.
  void* d_gate_rows = nullptr;    // [R, F]
  void* d_up_rows = nullptr;      // [R, F]
  void* d_shared_gate = nullptr;  // [T, Fs]
  void* d_shared_up = nullptr;    // [T, Fs]
};

}  // namespace mok
