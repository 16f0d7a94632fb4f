// XLA FFI targets of the CPU backend: plain C symbols (XLA_FFI_Error*(CallFrame*)),
// exported to Python as capsules by module_cpu.cc, or loaded with ctypes from
// the Bazel-built shared library.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "ffi_args.h"
#include "forward_cpu.h"
#include "peer_cpu.h"

namespace mok {
namespace {

// A ParallelFor on XLA's intra-op pool. The calling thread claims items too,
// so all items finish even if no pool thread ever runs (no deadlock when the
// pool is busy); pool tasks that start late find nothing left and exit, and
// they only touch the shared state they co-own.
ParallelFor pool_for(ffi::ThreadPool& pool) {
  return [&pool](int64_t n, const std::function<void(int64_t)>& fn) {
    struct State {
      std::atomic<int64_t> next{0}, done{0};
      int64_t n = 0;
      const std::function<void(int64_t)>* fn = nullptr;
      std::mutex m;
      std::condition_variable cv;
    };
    auto st = std::make_shared<State>();
    st->n = n;
    st->fn = &fn;
    auto work = [st] {
      for (int64_t i; (i = st->next.fetch_add(1)) < st->n;) {
        (*st->fn)(i);
        if (st->done.fetch_add(1) + 1 == st->n) {
          std::lock_guard<std::mutex> lock(st->m);
          st->cv.notify_all();
        }
      }
    };
    const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
    for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));  // a copy per task
    work();
    std::unique_lock<std::mutex> lock(st->m);
    st->cv.wait(lock, [&] { return st->done.load() == st->n; });
  };
}

ffi::Error ForwardCpu(ffi::ThreadPool pool, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd, Buf wsg, Buf wsu,
                      Buf wsd, Ret y, Ret offsets, Ret row_pair, Ret pair_row, Ret gate_pre,
                      Ret up_pre, Ret sgate_pre, Ret sup_pre) {
  return run_forward(Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, y, offsets, row_pair,
                     pair_row, gate_pre, up_pre, sgate_pre, sup_pre,
                     [&](const Problem& p, const ForwardArgs& a) { return forward_cpu(p, a, pool_for(pool)); });
}

ffi::Error BackwardCpu(ffi::ThreadPool pool, Buf dy, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd, Buf wsg,
                       Buf wsu, Buf wsd, Buf offsets, Buf row_pair, Buf pair_row, Buf gate_pre,
                       Buf up_pre, Buf sgate_pre, Buf sup_pre, Ret dx, Ret dw, Ret dwg, Ret dwu,
                       Ret dwd, Ret dwsg, Ret dwsu, Ret dwsd) {
  return run_backward(
      dy, Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd},
      Residuals{offsets, row_pair, pair_row, gate_pre, up_pre, sgate_pre, sup_pre},
      Gradients{dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd},
      [&](const Problem& p, const BackwardArgs& a) { return backward_cpu(p, a, pool_for(pool)); });
}

// The peer dispatch over this process's CPU devices (peer_cpu.h). `devices`:
// the ordinals of every expert-axis group, `ranks` per group, rank-major.
PeerCpuCall peer_call(int32_t device, ffi::Span<const int32_t> devices, int32_t ranks, int32_t timeout_ms) {
  PeerCpuCall call;
  call.device = device;
  call.devices.assign(devices.begin(), devices.end());
  call.ranks = ranks;
  call.timeout_ms = timeout_ms;
  return call;
}

ffi::Error PeerForwardCpu(ffi::ThreadPool pool, int32_t device, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu,
                          Buf wd, Buf wsg, Buf wsu, Buf wsd, Ret y, ffi::Span<const int32_t> devices,
                          int32_t ranks, int32_t timeout_ms) {
  return run_peer_forward(Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, y, ranks,
                          [&](const Problem& p, const ForwardArgs& a) {
                            return peer_forward_cpu(p, peer_call(device, devices, ranks, timeout_ms), a,
                                                    pool_for(pool));
                          });
}

ffi::Error PeerBackwardCpu(ffi::ThreadPool pool, int32_t device, Buf dy, Buf x, Buf ids, Buf w, Buf mask, Buf wg,
                           Buf wu, Buf wd, Buf wsg, Buf wsu, Buf wsd, Ret dx, Ret dw, Ret dwg, Ret dwu, Ret dwd,
                           Ret dwsg, Ret dwsu, Ret dwsd, ffi::Span<const int32_t> devices, int32_t ranks,
                           int32_t timeout_ms) {
  return run_peer_backward(dy, Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd},
                           Gradients{dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd}, ranks,
                           [&](const Problem& p, const BackwardArgs& a) {
                             return peer_backward_cpu(p, peer_call(device, devices, ranks, timeout_ms), a,
                                                      pool_for(pool));
                           });
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokPeerFwdCpu, mok::PeerForwardCpu,
                              mok::BindPeerAttrs(mok::BindPeerForward(xla::ffi::Ffi::Bind()
                                                                          .Ctx<xla::ffi::ThreadPool>()
                                                                          .Ctx<xla::ffi::DeviceOrdinal>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokPeerBwdCpu, mok::PeerBackwardCpu,
                              mok::BindPeerAttrs(mok::BindPeerBackward(xla::ffi::Ffi::Bind()
                                                                           .Ctx<xla::ffi::ThreadPool>()
                                                                           .Ctx<xla::ffi::DeviceOrdinal>())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokExpertsFwdCpu, mok::ForwardCpu, mok::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(MokExpertsBwdCpu, mok::BackwardCpu, mok::BindBackward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
