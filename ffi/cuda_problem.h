// Host-side pieces shared by the CUDA forward and backward: the problem
// limits of the kernels and the carving of one XLA-owned workspace buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "plan.h"

namespace mok::cuda {

// nullptr when the CUDA kernels can take `p` (mok_jax/_ffi.py checks the same
// limits first, with messages naming the Python arguments).
inline const char* unsupported_problem(const Problem& p) {
  if (p.dtype != DType::kBF16) return "mok cuda: only bf16 is supported on CUDA";
  if (p.tile_rows != 128) return "mok cuda: tile_rows must be 128";
  if (p.tokens < 0 || p.hidden <= 0 || p.ffn <= 0 || p.experts <= 0 || p.top_k <= 0 || p.shared_ffn < 0)
    return "mok cuda: bad problem dimensions";
  if (p.hidden % 8 != 0 || p.ffn % 8 != 0 || p.shared_ffn % 8 != 0)
    return "mok cuda: H, F and Fs must be multiples of 8";
  if (p.top_k > 64) return "mok cuda: top_k > 64 unsupported";
  if (p.row_capacity() >= (int64_t(1) << 31) - 256 || p.pairs() >= (int64_t(1) << 31))
    return "mok cuda: too many rows";
  return nullptr;
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Hands out consecutive regions of a workspace, each rounded up to 256 bytes.
class WorkspaceCarver {
 public:
  size_t take(size_t bytes) {
    const size_t offset = end_;
    end_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return offset;
  }
  size_t total() const { return end_; }

 private:
  static constexpr size_t kAlign = 256;
  size_t end_ = 0;
};

}  // namespace mok::cuda
