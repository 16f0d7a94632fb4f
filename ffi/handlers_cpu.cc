// XLA FFI targets of the CPU backend: plain C symbols (XLA_FFI_Error*(CallFrame*)),
// exported to Python as capsules by module_cpu.cc, or loaded with ctypes from
// the Bazel-built shared library.
#include "ffi_args.h"
#include "forward_cpu.h"

namespace mok {
namespace {

ffi::Error ForwardCpu(Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd, Buf wsg, Buf wsu,
                      Buf wsd, Ret y, Ret offsets, Ret row_pair, Ret pair_row, Ret gate_pre,
                      Ret up_pre, Ret sgate_pre, Ret sup_pre) {
  return run_forward(Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, y, offsets, row_pair,
                     pair_row, gate_pre, up_pre, sgate_pre, sup_pre,
                     [](const Problem& p, const ForwardArgs& a) { return forward_cpu(p, a); });
}

ffi::Error BackwardCpu(Buf dy, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd, Buf wsg,
                       Buf wsu, Buf wsd, Buf offsets, Buf row_pair, Buf pair_row, Buf gate_pre,
                       Buf up_pre, Buf sgate_pre, Buf sup_pre, Ret dx, Ret dw, Ret dwg, Ret dwu,
                       Ret dwd, Ret dwsg, Ret dwsu, Ret dwsd) {
  return run_backward(
      dy, Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd},
      Residuals{offsets, row_pair, pair_row, gate_pre, up_pre, sgate_pre, sup_pre}, dx, dw, dwg,
      dwu, dwd, dwsg, dwsu, dwsd,
      [](const Problem& p, const BackwardArgs& a) { return backward_cpu(p, a); });
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokExpertsFwdCpu, mok::ForwardCpu, mok::BindForward(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokExpertsBwdCpu, mok::BackwardCpu, mok::BindBackward(xla::ffi::Ffi::Bind()));
