// The CPU backward, in MoK's task order per expert segment:
//   gd = dy_row @ w_down^T (down dgrad, unscaled), d_topk_weight = <gd, a>,
//   SwiGLU backward on w * gd, fused gate+up dgrad into one d_x row,
//   weight gradients with K over the segment's token rows,
// then the fixed-order combine of the d_x rows, plus the shared expert.
#include <vector>

#include "combine.h"
#include "dispatch.h"
#include "dtype.h"
#include "forward_cpu.h"
#include "gemm.h"
#include "swiglu.h"

namespace mok {

// (forward_cpu.h)
void ffn_backward(const Problem& prob, int64_t n, int64_t F, const float* scale, SegmentBuffers& b,
                  const float* wg, const float* wu, const float* wd, float* dwg, float* dwu,
                  float* dwd, float* dscale) {
  const int64_t H = prob.hidden;
  swiglu_forward_cpu(prob.dtype, n * F, b.g.data(), b.u.data(), b.act.data());
  transpose(wd, F, H, b.wt.data());  // [H, F]
  gemm_nn(n, F, H, b.dyr.data(), H, b.wt.data(), F, b.gd.data(), F, false);
  for (int64_t i = 0; i < n; ++i) {
    const float s = scale ? scale[i] : 1.0f;
    float dot = 0.0f;
    for (int64_t f = 0; f < F; ++f) {
      dot += b.gd[i * F + f] * b.act[i * F + f];
      b.gd[i * F + f] *= s;  // now d_act
    }
    if (dscale) dscale[i] = dot;
    if (scale)
      for (int64_t h = 0; h < H; ++h) b.dyr[i * H + h] *= s;  // now d_out, for d_w_down
  }
  swiglu_backward_cpu(n * F, b.g.data(), b.u.data(), b.gd.data(), b.dg.data(), b.du.data());
  transpose(wg, H, F, b.wt.data());  // [F, H]
  gemm_nn(n, H, F, b.dg.data(), F, b.wt.data(), H, b.dxs.data(), H, false);
  transpose(wu, H, F, b.wt.data());
  gemm_nn(n, H, F, b.du.data(), F, b.wt.data(), H, b.dxs.data(), H, true);
  gemm_tn(H, F, n, b.xs.data(), H, b.dg.data(), F, dwg, F, false);
  gemm_tn(H, F, n, b.xs.data(), H, b.du.data(), F, dwu, F, false);
  gemm_tn(F, H, n, b.act.data(), F, b.dyr.data(), H, dwd, H, false);
}

namespace {

void load_rows(DType dtype, const void* src, int64_t begin, int64_t n, int64_t width, float* dst) {
  for (int64_t i = 0; i < n * width; ++i) dst[i] = load_elem(dtype, src, begin * width + i);
}

}  // namespace

std::vector<float> shared_expert_backward_cpu(const Problem& prob, const BackwardArgs& a) {
  const ForwardArgs& f = a.fwd;
  const int64_t T = prob.tokens, H = prob.hidden, Fs = prob.shared_ffn;
  std::vector<float> dx_shared;
  if (Fs == 0) return dx_shared;
  SegmentBuffers b;
  // Masked tokens produced exact zeros, so their dy must not reach any gradient.
  b.resize(T, H, Fs);
  for (int64_t t = 0; t < T; ++t) {
    const bool live = f.token_mask[t] != 0;
    for (int64_t h = 0; h < H; ++h) {
      b.xs[t * H + h] = live ? load_elem(prob.dtype, f.x, t * H + h) : 0.0f;
      b.dyr[t * H + h] = live ? load_elem(prob.dtype, a.dy, t * H + h) : 0.0f;
    }
  }
  load_rows(prob.dtype, f.shared_gate_pre, 0, T, Fs, b.g.data());
  load_rows(prob.dtype, f.shared_up_pre, 0, T, Fs, b.u.data());
  const F32Slice wg(prob.dtype, f.ws_gate, 0, H * Fs), wu(prob.dtype, f.ws_up, 0, H * Fs),
      wd(prob.dtype, f.ws_down, 0, Fs * H);
  std::vector<float> sg(static_cast<size_t>(H * Fs)), su(sg.size()), sd(sg.size());
  ffn_backward(prob, T, Fs, nullptr, b, wg.data(), wu.data(), wd.data(), sg.data(), su.data(),
               sd.data(), nullptr);
  from_f32(prob.dtype, sg.data(), a.dws_gate, H * Fs);
  from_f32(prob.dtype, su.data(), a.dws_up, H * Fs);
  from_f32(prob.dtype, sd.data(), a.dws_down, Fs * H);
  dx_shared.swap(b.dxs);
  return dx_shared;
}

std::string backward_cpu(const Problem& prob, const BackwardArgs& a, const ParallelFor& pfor) {
  const ForwardArgs& f = a.fwd;
  const int64_t T = prob.tokens, H = prob.hidden, F = prob.ffn, E = prob.experts,
                K = prob.top_k, Fs = prob.shared_ffn, R = prob.row_capacity();
  for (int64_t p = 0; p < T * K; ++p) a.d_topk_weights[p] = 0.0f;

  std::vector<float> dx_rows(static_cast<size_t>(R * H), 0.0f);
  pfor(E, [&](int64_t e) {  // one expert per item: disjoint rows, pairs and dW slices
    const int64_t begin = f.expert_offsets[e];
    const int64_t n = segment_real_rows(f.row_pair, begin, f.expert_offsets[e + 1]);
    std::vector<float> dwg(static_cast<size_t>(H * F), 0.0f), dwu(dwg.size(), 0.0f),
        dwd(dwg.size(), 0.0f);  // no tokens: exact zero gradients
    if (n > 0) {
      SegmentBuffers b;
      b.resize(n, H, F);
      std::vector<float> scale(static_cast<size_t>(n)), dscale(static_cast<size_t>(n));
      gather_rows_cpu(prob, f.x, f.row_pair, begin, n, b.xs.data());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = f.row_pair[begin + i];
        scale[i] = f.topk_weights[p];
        load_rows(prob.dtype, a.dy, p / K, 1, H, b.dyr.data() + i * H);
      }
      load_rows(prob.dtype, f.gate_pre, begin, n, F, b.g.data());
      load_rows(prob.dtype, f.up_pre, begin, n, F, b.u.data());
      const F32Slice wg(prob.dtype, f.w_gate, e * H * F, H * F);
      const F32Slice wu(prob.dtype, f.w_up, e * H * F, H * F);
      const F32Slice wd(prob.dtype, f.w_down, e * F * H, F * H);
      ffn_backward(prob, n, F, scale.data(), b, wg.data(), wu.data(), wd.data(), dwg.data(),
                   dwu.data(), dwd.data(), dscale.data());
      for (int64_t i = 0; i < n; ++i) a.d_topk_weights[f.row_pair[begin + i]] = dscale[i];
      std::copy(b.dxs.begin(), b.dxs.end(), dx_rows.begin() + begin * H);
    }
    from_f32(prob.dtype, dwg.data(), elem_ptr(prob.dtype, a.dw_gate, e * H * F), H * F);
    from_f32(prob.dtype, dwu.data(), elem_ptr(prob.dtype, a.dw_up, e * H * F), H * F);
    from_f32(prob.dtype, dwd.data(), elem_ptr(prob.dtype, a.dw_down, e * F * H), F * H);
  });

  const std::vector<float> dx_shared = shared_expert_backward_cpu(prob, a);
  combine_rows_cpu(prob, nullptr, f.pair_row, dx_rows.data(),
                   dx_shared.empty() ? nullptr : dx_shared.data(), a.dx);
  return {};
}

}  // namespace mok
