// Decoding XLA FFI buffers into the Problem / ForwardArgs / BackwardArgs of
// plan.h, shared by the CPU and CUDA handlers. Shapes are validated again
// here (Python validates first, with friendlier messages) so that a call
// built by hand can never make a kernel read or write out of bounds.
#pragma once

#include <string>
#include <utility>

#include "plan.h"
#include "xla/ffi/api/ffi.h"

namespace mok {

namespace ffi = xla::ffi;

using Buf = ffi::AnyBuffer;
using Ret = ffi::Result<ffi::AnyBuffer>;

// The forward's 10 inputs then 8 outputs (y and 7 residuals); the backward's dy, the same 10
// inputs, the 7 residuals, then 8 gradients.
template <typename B>
auto BindForward(B b) {
  return std::move(b).template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}

template <typename B>
auto BindBackward(B b) {
  return std::move(b).template Arg<Buf>()  // dy
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}

// The peer forward (peer_cpu.h, peer_forward.h): the same 10 inputs, w_* holding
// this rank's E/ranks experts, then y.
template <typename B>
auto BindPeerForward(B b) {
  return std::move(b).template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Ret<Buf>();
}

// The peer backward: dy, the same 10 inputs, then the 8 gradients (w_* and
// their gradients: this rank's experts; shared-expert gradients: this rank's
// tokens' share).
template <typename B>
auto BindPeerBackward(B b) {
  return std::move(b).template Arg<Buf>()  // dy
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}

// The attributes every peer call carries (then its handler's own):
// `devices`, every expert-axis group's device ordinals (rank-major), `ranks`
// per group, and the lost-peer timeout.
template <typename B>
auto BindPeerAttrs(B b) {
  return std::move(b).template Attr<ffi::Span<const int32_t>>("devices").template Attr<int32_t>("ranks")
      .template Attr<int32_t>("timeout_ms");
}

struct Inputs {
  Buf x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd;
};
struct Residuals {
  Buf offsets, row_pair, pair_row, gate_pre, up_pre, sgate_pre, sup_pre;
};

namespace detail {

inline std::string dims_str(const Buf& b) {
  std::string s = "[";
  auto d = b.dimensions();
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline bool has_shape(const Buf& b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

inline std::string expect(const char* name, const Buf& b, std::initializer_list<int64_t> want,
                          ffi::DataType dtype) {
  if (b.element_type() != dtype) return std::string(name) + ": unexpected element type";
  if (!has_shape(b, want)) {
    std::string w = "[";
    size_t i = 0;
    for (int64_t v : want) w += (i++ ? ", " : "") + std::to_string(v);
    return std::string(name) + " has shape " + dims_str(b) + ", expected " + w + "]";
  }
  return {};
}

}  // namespace detail

// Fills `prob` from the inputs and checks every input's shape and dtype.
inline std::string decode_inputs(const Inputs& in, Problem& prob) {
  using detail::expect;
  auto xd = in.x.dimensions();
  auto gd = in.wg.dimensions();
  auto idd = in.ids.dimensions();
  auto sd = in.wsg.dimensions();
  if (xd.size() != 2) return "x must be [T, H], got " + detail::dims_str(in.x);
  if (gd.size() != 3) return "w_gate must be [E, H, F], got " + detail::dims_str(in.wg);
  if (idd.size() != 2) return "topk_ids must be [T, K], got " + detail::dims_str(in.ids);
  if (sd.size() != 2) return "ws_gate must be [H, Fs], got " + detail::dims_str(in.wsg);
  const ffi::DataType dt = in.x.element_type();
  if (dt != ffi::DataType::F32 && dt != ffi::DataType::BF16) return "x must be float32 or bfloat16";
  prob.tokens = xd[0];
  prob.hidden = xd[1];
  prob.experts = gd[0];
  prob.ffn = gd[2];
  prob.top_k = idd[1];
  prob.shared_ffn = sd[1];
  prob.dtype = dt == ffi::DataType::BF16 ? DType::kBF16 : DType::kF32;
  const int64_t T = prob.tokens, H = prob.hidden, E = prob.experts, F = prob.ffn,
                K = prob.top_k, Fs = prob.shared_ffn;
  for (const std::string& err : {
           expect("topk_ids", in.ids, {T, K}, ffi::DataType::S32),
           expect("topk_weights", in.weights, {T, K}, ffi::DataType::F32),
           expect("token_mask", in.mask, {T}, ffi::DataType::U8),
           expect("w_gate", in.wg, {E, H, F}, dt),
           expect("w_up", in.wu, {E, H, F}, dt),
           expect("w_down", in.wd, {E, F, H}, dt),
           expect("ws_gate", in.wsg, {H, Fs}, dt),
           expect("ws_up", in.wsu, {H, Fs}, dt),
           expect("ws_down", in.wsd, {Fs, H}, dt),
       })
    if (!err.empty()) return err;
  return {};
}

// Whether a forward's four pre-activation results are dropped: a forward
// that keeps no residuals (nothing differentiates it) gets them with 0 rows.
inline bool pre_activations_dropped(const Problem& p, const Residuals& r) {
  const auto d = r.gate_pre.dimensions();
  return d.size() == 2 && d[0] == 0 && p.row_capacity() > 0;
}

// allow_dropped: the forward may get its pre-activation results with 0 rows
// (all four together); the backward needs them whole.
inline std::string check_residuals(const Problem& p, const Residuals& r, bool allow_dropped = false) {
  using detail::expect;
  const ffi::DataType dt = p.dtype == DType::kBF16 ? ffi::DataType::BF16 : ffi::DataType::F32;
  const int64_t R = p.row_capacity();
  const bool dropped = allow_dropped && pre_activations_dropped(p, r);
  const int64_t pre_rows = dropped ? 0 : R, shared_rows = dropped ? 0 : p.tokens;
  for (const std::string& err : {
           expect("expert_offsets", r.offsets, {p.experts + 1}, ffi::DataType::S32),
           expect("row_pair", r.row_pair, {R}, ffi::DataType::S32),
           expect("pair_row", r.pair_row, {p.pairs()}, ffi::DataType::S32),
           expect("gate_pre", r.gate_pre, {pre_rows, p.ffn}, dt),
           expect("up_pre", r.up_pre, {pre_rows, p.ffn}, dt),
           expect("shared_gate_pre", r.sgate_pre, {shared_rows, p.shared_ffn}, dt),
           expect("shared_up_pre", r.sup_pre, {shared_rows, p.shared_ffn}, dt),
       })
    if (!err.empty()) return err;
  return {};
}

// The inputs' pointers and y; the residual pointers null (the peer calls keep none).
inline ForwardArgs input_args(const Inputs& in, void* y) {
  ForwardArgs a{};
  a.x = in.x.untyped_data();
  a.topk_ids = static_cast<const int32_t*>(in.ids.untyped_data());
  a.topk_weights = static_cast<const float*>(in.weights.untyped_data());
  a.token_mask = static_cast<const uint8_t*>(in.mask.untyped_data());
  a.w_gate = in.wg.untyped_data();
  a.w_up = in.wu.untyped_data();
  a.w_down = in.wd.untyped_data();
  a.ws_gate = in.wsg.untyped_data();
  a.ws_up = in.wsu.untyped_data();
  a.ws_down = in.wsd.untyped_data();
  a.y = y;
  return a;
}

inline ForwardArgs forward_args(const Inputs& in, const Residuals& r, void* y) {
  ForwardArgs a = input_args(in, y);
  a.expert_offsets = static_cast<int32_t*>(r.offsets.untyped_data());
  a.row_pair = static_cast<int32_t*>(r.row_pair.untyped_data());
  a.pair_row = static_cast<int32_t*>(r.pair_row.untyped_data());
  // Empty results (dropped pre-activations, or no shared expert): nullptr,
  // whatever address XLA gives a zero-size buffer.
  auto data = [](const Buf& b) { return b.element_count() > 0 ? b.untyped_data() : nullptr; };
  a.gate_pre = data(r.gate_pre);
  a.up_pre = data(r.up_pre);
  a.shared_gate_pre = data(r.sgate_pre);
  a.shared_up_pre = data(r.sup_pre);
  return a;
}

// The backward's results: d_x, d_topk_weights and the six weight gradients.
struct Gradients {
  Ret dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd;
};

inline std::string check_gradients(const Problem& prob, ffi::DataType dt, const Buf& dy, const Gradients& g) {
  using detail::expect;
  for (const std::string& e : {
           expect("dy", dy, {prob.tokens, prob.hidden}, dt),
           expect("dx", *g.dx, {prob.tokens, prob.hidden}, dt),
           expect("d_topk_weights", *g.dw, {prob.tokens, prob.top_k}, ffi::DataType::F32),
           expect("dw_gate", *g.dwg, {prob.experts, prob.hidden, prob.ffn}, dt),
           expect("dw_up", *g.dwu, {prob.experts, prob.hidden, prob.ffn}, dt),
           expect("dw_down", *g.dwd, {prob.experts, prob.ffn, prob.hidden}, dt),
           expect("dws_gate", *g.dwsg, {prob.hidden, prob.shared_ffn}, dt),
           expect("dws_up", *g.dwsu, {prob.hidden, prob.shared_ffn}, dt),
           expect("dws_down", *g.dwsd, {prob.shared_ffn, prob.hidden}, dt),
       })
    if (!e.empty()) return e;
  return {};
}

inline BackwardArgs backward_args(const Buf& dy, const ForwardArgs& fwd, Gradients& g) {
  BackwardArgs a;
  a.dy = dy.untyped_data();
  a.fwd = fwd;
  a.dx = g.dx->untyped_data();
  a.d_topk_weights = static_cast<float*>(g.dw->untyped_data());
  a.dw_gate = g.dwg->untyped_data();
  a.dw_up = g.dwu->untyped_data();
  a.dw_down = g.dwd->untyped_data();
  a.dws_gate = g.dwsg->untyped_data();
  a.dws_up = g.dwsu->untyped_data();
  a.dws_down = g.dwsd->untyped_data();
  return a;
}

// Decoding of a peer call (peer_cpu.h, peer_forward.h): `prob` gets this
// rank's tokens and, once valid, the global number of experts (ranks * the
// local w_gate's first axis).
inline std::string decode_peer_inputs(const Inputs& in, int ranks, Problem& prob) {
  std::string err = decode_inputs(in, prob);
  if (err.empty() && (ranks < 1 || ranks > 8)) err = "peer dispatch: ranks must be in [1, 8]";
  return err;
}

// The handlers' bodies are written once: `Run(prob, args)` returns an error
// message or an empty string; these adapters decode, validate and call it.
template <typename Run>
ffi::Error run_forward(const Inputs& in, Ret y, Ret offsets, Ret row_pair, Ret pair_row,
                       Ret gate_pre, Ret up_pre, Ret sgate_pre, Ret sup_pre, Run&& run) {
  Problem prob;
  std::string err = decode_inputs(in, prob);
  const Residuals res{*offsets, *row_pair, *pair_row, *gate_pre, *up_pre, *sgate_pre, *sup_pre};
  if (err.empty()) err = check_residuals(prob, res, /*allow_dropped=*/true);
  if (err.empty() && !detail::has_shape(*y, {prob.tokens, prob.hidden}))
    err = "y has shape " + detail::dims_str(*y);
  if (err.empty()) err = run(prob, forward_args(in, res, y->untyped_data()));
  return err.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(err);
}

template <typename Run>
ffi::Error run_peer_forward(const Inputs& in, Ret y, int ranks, Run&& run) {
  Problem prob;
  std::string err = decode_peer_inputs(in, ranks, prob);
  if (err.empty() && !detail::has_shape(*y, {prob.tokens, prob.hidden}))
    err = "y has shape " + detail::dims_str(*y);
  if (err.empty()) {
    prob.experts *= ranks;
    err = run(prob, input_args(in, y->untyped_data()));
  }
  return err.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(err);
}

template <typename Run>
ffi::Error run_backward(Buf dy, const Inputs& in, const Residuals& res, Gradients g, Run&& run) {
  Problem prob;
  std::string err = decode_inputs(in, prob);
  if (err.empty()) err = check_residuals(prob, res);
  if (err.empty()) err = check_gradients(prob, in.x.element_type(), dy, g);
  if (err.empty()) err = run(prob, backward_args(dy, forward_args(in, res, nullptr), g));
  return err.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(err);
}

template <typename Run>
ffi::Error run_peer_backward(Buf dy, const Inputs& in, Gradients g, int ranks, Run&& run) {
  Problem prob;
  std::string err = decode_peer_inputs(in, ranks, prob);
  if (err.empty()) err = check_gradients(prob, in.x.element_type(), dy, g);  // E: this rank's experts
  if (err.empty()) {
    prob.experts *= ranks;
    err = run(prob, backward_args(dy, input_args(in, nullptr), g));
  }
  return err.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(err);
}

}  // namespace mok
