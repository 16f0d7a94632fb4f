// Stage 4: the SwiGLU activation a = silu(g) * u and its backward.
#pragma once

#include <cmath>
#include <cstdint>

#include "plan.h"

namespace mok {

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// a[i] = round_to(dtype, silu(g[i]) * u[i]): the hidden activation is stored
// in the input dtype before the down projection, on every backend.
void swiglu_forward_cpu(DType dtype, int64_t n, const float* g, const float* u, float* a);

// Given da = dL/da: dg = da * u * silu'(g), du = da * silu(g).
void swiglu_backward_cpu(int64_t n, const float* g, const float* u, const float* da, float* dg,
                         float* du);

}  // namespace mok
