// Stage 2: dispatch, gathering routed token rows into expert-major rows.
// On CUDA this is the dispatch CTAs' pull into the ring (dispatch.cu); on the
// CPU one expert segment is gathered at a time into an fp32 buffer.
#pragma once

#include <cstdint>

#include "plan.h"

namespace mok {

// Real rows of a segment come first (placement fills from its start), so the
// count is the run of non-negative row_pair entries from `begin`.
int64_t segment_real_rows(const int32_t* row_pair, int64_t begin, int64_t end);

// xs[i, :] = x[row_pair[begin + i] / K, :] for i < n, in fp32.
void gather_rows_cpu(const Problem& prob, const void* x, const int32_t* row_pair, int64_t begin,
                     int64_t n, float* xs);

}  // namespace mok
