#include "dispatch.h"

#include "dtype.h"

namespace mok {

int64_t segment_real_rows(const int32_t* row_pair, int64_t begin, int64_t end) {
  int64_t n = 0;
  while (begin + n < end && row_pair[begin + n] >= 0) ++n;
  return n;
}

void gather_rows_cpu(const Problem& prob, const void* x, const int32_t* row_pair, int64_t begin,
                     int64_t n, float* xs) {
  const int64_t H = prob.hidden;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = row_pair[begin + i] / prob.top_k;
    for (int64_t h = 0; h < H; ++h) xs[i * H + h] = load_elem(prob.dtype, x, t * H + h);
  }
}

}  // namespace mok
