// Work distribution for the CPU backend: independent items (one expert
// segment each) run on XLA's intra-op thread pool. Each item writes disjoint
// outputs with a fixed arithmetic order, so results are bitwise the same for
// any thread count.
#pragma once

#include <cstdint>
#include <functional>

namespace mok {

// Runs fn(i) for every i in [0, n) and returns when all have finished.
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t)>& fn)>;

inline void serial_for(int64_t n, const std::function<void(int64_t)>& fn) {
  for (int64_t i = 0; i < n; ++i) fn(i);
}

}  // namespace mok
