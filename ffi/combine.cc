#include "combine.h"

#include <vector>

#include "dtype.h"

namespace mok {

void combine_rows_cpu(const Problem& prob, const float* w, const int32_t* pair_row,
                      const float* rows, const float* extra, void* out) {
  const int64_t T = prob.tokens, K = prob.top_k, H = prob.hidden;
  std::vector<float> acc(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) acc[h] = extra ? extra[t * H + h] : 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = pair_row[t * K + k];
      if (r < 0) continue;
      const float wk = w ? w[t * K + k] : 1.0f;
      const float* row = rows + static_cast<int64_t>(r) * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += wk * row[h];
    }
    for (int64_t h = 0; h < H; ++h) store_elem(prob.dtype, out, t * H + h, acc[h]);
  }
}

}  // namespace mok
