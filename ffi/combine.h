// Stage 6: the fixed-order combine.
#pragma once

#include <cstdint>

#include "plan.h"

namespace mok {

// out[t, :] = sum_{k = 0..K-1, in order} w[t, k] * rows[pair_row[t*K + k], :]
//             + extra[t, :]
// in fp32, stored in prob.dtype. `w` may be null (all ones: the backward's
// d_x), `extra` may be null (no shared expert). Unrouted pairs add nothing,
// so masked tokens get exact zeros.
void combine_rows_cpu(const Problem& prob, const float* w, const int32_t* pair_row,
                      const float* rows, const float* extra, void* out);

}  // namespace mok
