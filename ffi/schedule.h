// Stage 1, the routing schedule: count -> pad -> place (no sort).
#pragma once

#include <string>

#include "plan.h"

namespace mok {

// Fills expert_offsets[E+1], row_pair[R] and pair_row[T*K] (layout in plan.h).
// Rows of one expert are in increasing pair index, the order every backend
// uses. Returns an empty string, or a message naming the bad argument (an id
// outside [0, E)); on error nothing is routed.
std::string build_schedule_cpu(const Problem& prob, const int32_t* topk_ids,
                               const uint8_t* token_mask, int32_t* expert_offsets,
                               int32_t* row_pair, int32_t* pair_row);

}  // namespace mok
