// The nanobind module `_mok_cpu`: the CPU FFI targets as capsules, by name.
#include <nanobind/nanobind.h>

#include "plan.h"
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* MokExpertsFwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MokExpertsBwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MokPeerFwdCpu(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MokPeerBwdCpu(XLA_FFI_CallFrame* call_frame);
}

NB_MODULE(_mok_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["mok_experts_fwd_cpu"] = nanobind::capsule(reinterpret_cast<void*>(MokExpertsFwdCpu));
    d["mok_experts_bwd_cpu"] = nanobind::capsule(reinterpret_cast<void*>(MokExpertsBwdCpu));
    d["mok_peer_fwd_cpu"] = nanobind::capsule(reinterpret_cast<void*>(MokPeerFwdCpu));
    d["mok_peer_bwd_cpu"] = nanobind::capsule(reinterpret_cast<void*>(MokPeerBwdCpu));
    return d;
  });
  m.attr("tile_rows") = mok::kTileRows;
}
