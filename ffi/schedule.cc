#include "schedule.h"

#include <vector>

namespace mok {

std::string build_schedule_cpu(const Problem& prob, const int32_t* topk_ids,
                               const uint8_t* token_mask, int32_t* expert_offsets,
                               int32_t* row_pair, int32_t* pair_row) {
  const int64_t T = prob.tokens, K = prob.top_k, E = prob.experts;
  const int64_t R = prob.row_capacity();
  for (int64_t r = 0; r < R; ++r) row_pair[r] = -1;
  for (int64_t p = 0; p < T * K; ++p) pair_row[p] = -1;

  // count (validating every id of a routed token first: never index with a bad one)
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    if (!token_mask[t]) continue;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = topk_ids[t * K + k];
      if (e < 0 || e >= E) {
        for (int64_t i = 0; i <= E; ++i) expert_offsets[i] = 0;
        return "topk_ids[" + std::to_string(t) + ", " + std::to_string(k) + "] = " +
               std::to_string(e) + " is outside [0, " + std::to_string(E) +
               "): expert ids must index w_gate's first axis";
      }
      ++counts[e];
    }
  }
  // pad each segment to the tile height
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    expert_offsets[e] = static_cast<int32_t>(row);
    row += (counts[e] + prob.tile_rows - 1) / prob.tile_rows * prob.tile_rows;
  }
  expert_offsets[E] = static_cast<int32_t>(row);
  // place, in increasing pair index within each expert
  std::vector<int64_t> cursor(expert_offsets, expert_offsets + E);
  for (int64_t t = 0; t < T; ++t) {
    if (!token_mask[t]) continue;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      const int64_t r = cursor[topk_ids[p]]++;
      row_pair[r] = static_cast<int32_t>(p);
      pair_row[p] = static_cast<int32_t>(r);
    }
  }
  return {};
}

}  // namespace mok
