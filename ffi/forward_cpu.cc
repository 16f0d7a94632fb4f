#include <algorithm>
#include <vector>

#include "combine.h"
#include "dispatch.h"
#include "dtype.h"
#include "forward_cpu.h"
#include "gemm.h"
#include "schedule.h"
#include "swiglu.h"

namespace mok {

std::vector<float> shared_expert_forward_cpu(const Problem& prob, const ForwardArgs& a) {
  const int64_t T = prob.tokens, H = prob.hidden, Fs = prob.shared_ffn;
  std::vector<float> out;
  if (Fs == 0) return out;
  std::vector<float> xs(static_cast<size_t>(T * H), 0.0f);
  for (int64_t t = 0; t < T; ++t)
    if (a.token_mask[t])
      for (int64_t h = 0; h < H; ++h) xs[t * H + h] = load_elem(prob.dtype, a.x, t * H + h);
  const F32Slice wg(prob.dtype, a.ws_gate, 0, H * Fs), wu(prob.dtype, a.ws_up, 0, H * Fs),
      wd(prob.dtype, a.ws_down, 0, Fs * H);
  std::vector<float> g(static_cast<size_t>(T * Fs)), u(g.size()), act(g.size());
  gemm_nn(T, Fs, H, xs.data(), H, wg.data(), Fs, g.data(), Fs, false);
  gemm_nn(T, Fs, H, xs.data(), H, wu.data(), Fs, u.data(), Fs, false);
  if (a.shared_gate_pre != nullptr) {  // null: a forward that keeps no residuals
    from_f32(prob.dtype, g.data(), a.shared_gate_pre, T * Fs);
    from_f32(prob.dtype, u.data(), a.shared_up_pre, T * Fs);
  }
  swiglu_forward_cpu(prob.dtype, T * Fs, g.data(), u.data(), act.data());
  out.resize(static_cast<size_t>(T * H));
  gemm_nn(T, H, Fs, act.data(), Fs, wd.data(), H, out.data(), H, false);
  return out;
}

std::string forward_cpu(const Problem& prob, const ForwardArgs& a, const ParallelFor& pfor) {
  const int64_t H = prob.hidden, F = prob.ffn, E = prob.experts, R = prob.row_capacity();
  std::string err = build_schedule_cpu(prob, a.topk_ids, a.token_mask, a.expert_offsets,
                                       a.row_pair, a.pair_row);
  if (!err.empty()) return err;

  // Residual rows that hold no pair (padding) are written as zeros. A forward
  // that keeps no residuals gets null gate_pre / up_pre.
  const bool keep_pre = a.gate_pre != nullptr;
  for (int64_t r = 0; keep_pre && r < R; ++r) {
    if (a.row_pair[r] >= 0) continue;
    for (int64_t f = 0; f < F; ++f) {
      store_elem(prob.dtype, a.gate_pre, r * F + f, 0.0f);
      store_elem(prob.dtype, a.up_pre, r * F + f, 0.0f);
    }
  }

  std::vector<float> out_rows(static_cast<size_t>(R * H), 0.0f);
  pfor(E, [&](int64_t e) {  // one expert segment per item: disjoint rows
    const int64_t begin = a.expert_offsets[e];
    const int64_t n = segment_real_rows(a.row_pair, begin, a.expert_offsets[e + 1]);
    if (n == 0) return;
    std::vector<float> xs(static_cast<size_t>(n * H)), g(static_cast<size_t>(n * F)),
        u(g.size()), act(g.size());
    gather_rows_cpu(prob, a.x, a.row_pair, begin, n, xs.data());
    const F32Slice wg(prob.dtype, a.w_gate, e * H * F, H * F);
    const F32Slice wu(prob.dtype, a.w_up, e * H * F, H * F);
    const F32Slice wd(prob.dtype, a.w_down, e * F * H, F * H);
    gemm_nn(n, F, H, xs.data(), H, wg.data(), F, g.data(), F, false);
    gemm_nn(n, F, H, xs.data(), H, wu.data(), F, u.data(), F, false);
    if (keep_pre) {
      from_f32(prob.dtype, g.data(), elem_ptr(prob.dtype, a.gate_pre, begin * F), n * F);
      from_f32(prob.dtype, u.data(), elem_ptr(prob.dtype, a.up_pre, begin * F), n * F);
    }
    swiglu_forward_cpu(prob.dtype, n * F, g.data(), u.data(), act.data());
    gemm_nn(n, H, F, act.data(), F, wd.data(), H, out_rows.data() + begin * H, H, false);
  });

  const std::vector<float> shared = shared_expert_forward_cpu(prob, a);
  combine_rows_cpu(prob, a.topk_weights, a.pair_row, out_rows.data(),
                   shared.empty() ? nullptr : shared.data(), a.y);
  return {};
}

}  // namespace mok
