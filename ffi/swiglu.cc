#include "swiglu.h"

#include "dtype.h"

namespace mok {

void swiglu_forward_cpu(DType dtype, int64_t n, const float* g, const float* u, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i] = round_to(dtype, g[i] * sigmoid(g[i]) * u[i]);
}

void swiglu_backward_cpu(int64_t n, const float* g, const float* u, const float* da, float* dg,
                         float* du) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(g[i]);
    const float silu = g[i] * s;
    du[i] = da[i] * silu;
    dg[i] = da[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
  }
}

}  // namespace mok
