// Element conversions between the storage dtypes (f32, bf16) and the fp32
// the CPU backend computes in. bf16 rounding is round-to-nearest-even, the
// same as the GPU's __float2bfloat16_rn, so residuals match across backends.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "plan.h"

namespace mok {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Rounds an fp32 value to what storing it in `dtype` keeps.
inline float round_to(DType dtype, float v) {
  return dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

inline int64_t elem_bytes(DType dtype) { return dtype == DType::kBF16 ? 2 : 4; }

inline void* elem_ptr(DType dtype, void* base, int64_t i) {
  return static_cast<char*>(base) + i * elem_bytes(dtype);
}

inline float load_elem(DType dtype, const void* p, int64_t i) {
  return dtype == DType::kBF16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

inline void store_elem(DType dtype, void* p, int64_t i, float v) {
  if (dtype == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// Whole-tensor conversions (the CPU backend computes on fp32 copies).
inline std::vector<float> to_f32(DType dtype, const void* p, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = load_elem(dtype, p, i);
  return out;
}

inline void from_f32(DType dtype, const float* src, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_elem(dtype, dst, i, src[i]);
}

}  // namespace mok

namespace mok {

// A read-only fp32 view of n elements at `offset` of a tensor: aliases f32
// data, converts bf16 data into an owned copy.
class F32Slice {
 public:
  F32Slice(DType dtype, const void* base, int64_t offset, int64_t n) {
    if (dtype == DType::kF32) {
      ptr_ = static_cast<const float*>(base) + offset;
    } else {
      owned_.resize(static_cast<size_t>(n));
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) owned_[i] = bf16_to_f32(src[i]);
      ptr_ = owned_.data();
    }
  }
  const float* data() const { return ptr_; }

 private:
  std::vector<float> owned_;
  const float* ptr_ = nullptr;
};

}  // namespace mok
