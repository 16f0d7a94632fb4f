// XLA FFI targets of the CUDA backend, exported as capsules by the nanobind
// module `_mok_cuda`. The forward's device workspace is one more XLA output
// (uint8[forward_workspace_bytes]) rather than a per-call allocation: XLA
// places it at compile time, and its lifetime covers the stream-ordered work.
// The backward has a workspace output too, plus four results aliased with the
// gate/up residuals (input_output_aliases in mok_jax/_ffi.py), where it writes
// the gate/up gradient rows over the spent pre-activations.
// Both handlers launch exactly the same device work on every call (grids are
// sized from static capacities, real counts are read on the device, no
// allocation, no host sync), so they are marked command-buffer (CUDA graph)
// compatible; the MOK_JAX_CHECK_IDS debug sync refuses to run under capture.
// The forward's attributes are the megakernel knobs (mok_jax.MegakernelConfig;
// 0 = default).
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "backward_cuda.h"
#include "ffi_args.h"
#include "gemm_tile.cuh"  // MOK_GEMM_TMA_STORE
#include "forward_cuda.h"
#include "peer_backward.h"
#include "peer_forward.h"
#include "peer_runtime.h"

namespace mok {
namespace {

// MOK_JAX_CHECK_IDS=1: after each forward, wait for the stream and turn the
// device's "id outside [0, E)" flag into an error naming topk_ids. Off by
// default because it synchronises the host with the GPU on every call.
bool check_ids_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MOK_JAX_CHECK_IDS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Calls that ran while XLA was capturing the stream into a CUDA graph (a
// command buffer): `_mok_cuda.captured_calls()`, so a test can see that XLA
// really put these targets into graphs.
std::atomic<int64_t> g_captured_calls{0};

void count_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusActive)
    g_captured_calls.fetch_add(1);
}

ffi::Error ForwardCuda(cudaStream_t stream, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu,
                       Buf wd, Buf wsg, Buf wsu, Buf wsd, Ret y, Ret offsets, Ret row_pair,
                       Ret pair_row, Ret gate_pre, Ret up_pre, Ret sgate_pre, Ret sup_pre,
                       Ret workspace, int32_t persistent, int32_t dispatch_ctas, int32_t minibatch_rows,
                       int32_t ring_rows) {
  const cuda::MegakernelConfig cfg{persistent, dispatch_ctas, minibatch_rows, ring_rows};
  count_capture(stream);
  return run_forward(
      Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, y, offsets, row_pair, pair_row,
      gate_pre, up_pre, sgate_pre, sup_pre,
      [&](const Problem& p, const ForwardArgs& a) -> std::string {
        if (p.dtype != DType::kBF16) return "the CUDA backend supports bfloat16 only";
        cuda::MegakernelPlan plan;
        if (cfg.persistent != 0)
          if (const char* err = cuda::resolve_megakernel(p, cfg, &plan)) return err;
        const size_t need = cuda::forward_workspace_bytes(p, cfg);
        if (workspace->size_bytes() < need)
          return "workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
                 std::to_string(need);
        void* ws = workspace->untyped_data();
        if (const char* err = cuda::forward(p, a, ws, stream, nullptr, cfg)) return err;
        if (!check_ids_enabled()) return {};
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
            capture != cudaStreamCaptureStatusNone)
          return "MOK_JAX_CHECK_IDS=1 synchronises the stream and cannot run inside a CUDA graph: "
                 "also set XLA_FLAGS=--xla_gpu_enable_command_buffer= (graphs off)";
        int32_t flags = 0;
        const char* base = static_cast<const char*>(ws);
        if (cudaMemcpyAsync(&flags, base + cuda::forward_workspace_flags_offset(p, cfg), sizeof(flags),
                            cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
            cudaStreamSynchronize(stream) != cudaSuccess)
          return std::string("reading the id-check flag failed: ") +
                 cudaGetErrorString(cudaGetLastError());
        if (flags & 1)
          return "topk_ids holds an expert id outside [0, " + std::to_string(p.experts) +
                 "): expert ids must index w_gate's first axis";
        return {};
      });
}

ffi::Error BackwardCuda(cudaStream_t stream, Buf dy, Buf x, Buf ids, Buf w, Buf mask, Buf wg,
                        Buf wu, Buf wd, Buf wsg, Buf wsu, Buf wsd, Buf offsets, Buf row_pair,
                        Buf pair_row, Buf gate_pre, Buf up_pre, Buf sgate_pre, Buf sup_pre, Ret dx,
                        Ret dw, Ret dwg, Ret dwu, Ret dwd, Ret dwsg, Ret dwsu, Ret dwsd,
                        Ret workspace, Ret d_gate_rows, Ret d_up_rows, Ret d_shared_gate,
                        Ret d_shared_up, int32_t persistent) {
  count_capture(stream);
  const bool megakernel = persistent != 0;  // MegakernelConfig.persistent_backward
  return run_backward(
      dy, Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd},
      Residuals{offsets, row_pair, pair_row, gate_pre, up_pre, sgate_pre, sup_pre},
      Gradients{dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd}, [&](const Problem& p, const BackwardArgs& args) -> std::string {
        if (p.dtype != DType::kBF16) return "the CUDA backend supports bfloat16 only";
        const size_t need = cuda::backward_workspace_bytes(p, megakernel);
        if (workspace->size_bytes() < need)
          return "workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
                 std::to_string(need);
        // The gradient-row scratch: results aliased with the residuals (same shapes).
        const size_t rows_bytes = static_cast<size_t>(p.row_capacity()) * p.ffn * 2;
        const size_t shared_bytes = static_cast<size_t>(p.tokens) * p.shared_ffn * 2;
        if (d_gate_rows->size_bytes() < rows_bytes || d_up_rows->size_bytes() < rows_bytes ||
            d_shared_gate->size_bytes() < shared_bytes || d_shared_up->size_bytes() < shared_bytes)
          return "the backward's gradient-row results are smaller than gate_pre/up_pre";
        BackwardArgs a = args;
        a.d_gate_rows = d_gate_rows->untyped_data();
        a.d_up_rows = d_up_rows->untyped_data();
        a.d_shared_gate = d_shared_gate->untyped_data();
        a.d_shared_up = d_shared_up->untyped_data();
        if (const char* err = cuda::backward(p, a, workspace->untyped_data(), stream, nullptr, megakernel)) return err;
        return {};
      });
}

// The bf16 problem the size functions of the Python module describe.
Problem bf16_problem(int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs) {
  Problem p;
  p.tokens = T, p.hidden = H, p.ffn = F, p.experts = E, p.top_k = K, p.shared_ffn = Fs;
  p.dtype = DType::kBF16;
  return p;
}

// The round size of a peer call: the requested one, or (0) the default.
int64_t peer_round_rows(const Problem& p, int ranks, int64_t requested) {
  return requested > 0 ? requested : cuda::peer_default_round_rows(p, ranks);
}

// This GPU's PeerGroup and round size for a peer call, or an error.
std::string peer_setup(const Problem& p, ffi::Span<const int32_t> devices, int32_t ranks, int32_t timeout_ms,
                       int32_t round_rows, cuda::PeerGroup* group, int64_t* C) {
  if (p.dtype != DType::kBF16) return "the CUDA backend supports bfloat16 only";
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return "peer dispatch: cannot query the device";
  const std::vector<int32_t> list(devices.begin(), devices.end());
  const uint64_t timeout_ns = static_cast<uint64_t>(timeout_ms > 0 ? timeout_ms : 1) * 1000000ull;
  if (const char* err = cuda::peer_group_for(dev, list, ranks, timeout_ns, group)) return err;
  *C = peer_round_rows(p, ranks, round_rows);
  if (const char* err = cuda::peer_check(p, ranks, *C)) return err;
  return {};
}

std::string check_workspace(const Ret& workspace, size_t need) {
  if (workspace->size_bytes() >= need) return {};
  return "workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " + std::to_string(need);
}

cuda::PeerForwardArgs peer_args(const ForwardArgs& a) {
  return cuda::PeerForwardArgs{a.x,      a.topk_ids, a.topk_weights, a.token_mask, a.w_gate, a.w_up,
                               a.w_down, a.ws_gate,  a.ws_up,        a.ws_down,    a.y};
}

// The peer-dispatch forward (peer_forward.h) and backward (peer_backward.h)
// of this GPU's rank: the group's control blocks come from peer_runtime.h;
// the workspace is an XLA output. Not marked command-buffer compatible: the
// process's first call initialises the runtime (allocation, preload,
// synchronisation), which a capture forbids.
// The forward keeps round 0's gate/up pre-activations ([round_rows, F] each,
// two more results) for the backward, which takes them as two more operands
// (zero-size there: nothing kept, every round recomputed).
std::string check_kept(const Problem& p, int64_t C, const Buf& gate, const Buf& up, bool empty_ok = false) {
  if (empty_ok && gate.size_bytes() == 0 && up.size_bytes() == 0) return {};
  const int64_t want = C * p.ffn * 2;
  if (static_cast<int64_t>(gate.size_bytes()) != want || static_cast<int64_t>(up.size_bytes()) != want)
    return "kept pre-activations must be [round_rows=" + std::to_string(C) + ", F] bfloat16";
  return {};
}

ffi::Error PeerForwardCuda(cudaStream_t stream, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd, Buf wsg,
                           Buf wsu, Buf wsd, Ret y, Ret workspace, Ret keep_gate, Ret keep_up,
                           ffi::Span<const int32_t> devices, int32_t ranks, int32_t timeout_ms, int32_t round_rows) {
  return run_peer_forward(
      Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, y, ranks,
      [&](const Problem& p, const ForwardArgs& a) -> std::string {
        cuda::PeerGroup group;
        int64_t C = 0;
        if (std::string e = peer_setup(p, devices, ranks, timeout_ms, round_rows, &group, &C); !e.empty()) return e;
        if (std::string e = check_workspace(workspace, cuda::peer_forward_workspace_bytes(p, ranks, C, group.staging != nullptr)); !e.empty())
          return e;
        if (std::string e = check_kept(p, C, *keep_gate, *keep_up); !e.empty()) return e;
        cuda::PeerForwardArgs pa = peer_args(a);
        pa.keep_gate = keep_gate->untyped_data();
        pa.keep_up = keep_up->untyped_data();
        if (const char* err = cuda::peer_forward(p, group, pa, workspace->untyped_data(), C, stream)) return err;
        return {};
      });
}

ffi::Error PeerBackwardCuda(cudaStream_t stream, Buf dy, Buf x, Buf ids, Buf w, Buf mask, Buf wg, Buf wu, Buf wd,
                            Buf wsg, Buf wsu, Buf wsd, Ret dx, Ret dw, Ret dwg, Ret dwu, Ret dwd, Ret dwsg,
                            Ret dwsu, Ret dwsd, Ret workspace, Buf kept_gate, Buf kept_up,
                            ffi::Span<const int32_t> devices, int32_t ranks, int32_t timeout_ms, int32_t round_rows) {
  return run_peer_backward(
      dy, Inputs{x, ids, w, mask, wg, wu, wd, wsg, wsu, wsd}, Gradients{dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd},
      ranks, [&](const Problem& p, const BackwardArgs& a) -> std::string {
        cuda::PeerGroup group;
        int64_t C = 0;
        if (std::string e = peer_setup(p, devices, ranks, timeout_ms, round_rows, &group, &C); !e.empty()) return e;
        if (std::string e = check_workspace(workspace, cuda::peer_backward_workspace_bytes(p, ranks, C, group.staging != nullptr));
            !e.empty())
          return e;
        if (std::string e = check_kept(p, C, kept_gate, kept_up, true); !e.empty()) return e;
        const bool kept = kept_gate.size_bytes() > 0;
        cuda::PeerBackwardArgs b{a.dy,      peer_args(a.fwd), a.dx,       a.d_topk_weights, a.dw_gate,
                                 a.dw_up,   a.dw_down,        a.dws_gate, a.dws_up,         a.dws_down,
                                 kept ? kept_gate.untyped_data() : nullptr,
                                 kept ? kept_up.untyped_data() : nullptr};
        if (const char* err = cuda::peer_backward(p, group, b, workspace->untyped_data(), C, stream)) return err;
        return {};
      });
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokPeerFwdCuda, mok::PeerForwardCuda,
    mok::BindPeerAttrs(mok::BindPeerForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
                           .Ret<mok::Buf>()   // + workspace
                           .Ret<mok::Buf>()   // + round 0's gate_pre [round_rows, F], kept for the backward
                           .Ret<mok::Buf>())  // + round 0's up_pre
        .Attr<int32_t>("round_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokPeerBwdCuda, mok::PeerBackwardCuda,
    mok::BindPeerAttrs(mok::BindPeerBackward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
                           .Ret<mok::Buf>()   // + workspace
                           .Arg<mok::Buf>()   // + the forward's kept gate_pre of round 0
                           .Arg<mok::Buf>())  // + and up_pre
        .Attr<int32_t>("round_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertsBwdCuda, mok::BackwardCuda,
    mok::BindBackward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
        .Ret<mok::Buf>()   // + workspace
        .Ret<mok::Buf>()   // + d_gate_rows [R, F], aliased with gate_pre
        .Ret<mok::Buf>()   // + d_up_rows [R, F], aliased with up_pre
        .Ret<mok::Buf>()   // + d_shared_gate [T, Fs], aliased with shared_gate_pre
        .Ret<mok::Buf>()   // + d_shared_up [T, Fs], aliased with shared_up_pre
        .Attr<int32_t>("persistent"),  // 1: the backward megakernel (megakernel_bwd.cuh)
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertsFwdCuda, mok::ForwardCuda,
    mok::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>())
        .Ret<mok::Buf>()  // + workspace
        .Attr<int32_t>("persistent")
        .Attr<int32_t>("dispatch_ctas")
        .Attr<int32_t>("minibatch_rows")
        .Attr<int32_t>("ring_rows"),
    {xla::ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_mok_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    d["mok_experts_fwd_cuda"] = nanobind::capsule(reinterpret_cast<void*>(MokExpertsFwdCuda));
    d["mok_experts_bwd_cuda"] = nanobind::capsule(reinterpret_cast<void*>(MokExpertsBwdCuda));
    d["mok_peer_fwd_cuda"] = nanobind::capsule(reinterpret_cast<void*>(MokPeerFwdCuda));
    d["mok_peer_bwd_cuda"] = nanobind::capsule(reinterpret_cast<void*>(MokPeerBwdCuda));
    return d;
  });
  // forward_workspace_bytes(T, H, F, E, K, Fs, persistent, dispatch_ctas,
  // minibatch_rows, ring_rows): 0 when the problem or the knobs are rejected.
  m.def("forward_workspace_bytes", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K,
                                      int64_t Fs, int32_t persistent, int32_t dispatch_ctas,
                                      int32_t minibatch_rows, int32_t ring_rows) {
    return mok::cuda::forward_workspace_bytes(
        mok::bf16_problem(T, H, F, E, K, Fs),
        mok::cuda::MegakernelConfig{persistent, dispatch_ctas, minibatch_rows, ring_rows});
  });
  // persistent: the backward megakernel's layout (MegakernelConfig.persistent_backward).
  m.def("backward_workspace_bytes", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs,
                                       bool persistent) {
    return mok::cuda::backward_workspace_bytes(mok::bf16_problem(T, H, F, E, K, Fs), persistent);
  });
  // peer_forward_workspace_bytes(T_local, H, F, E, K, Fs, ranks, round_rows,
  // staged): 0 when rejected; round_rows 0 = the default
  // (peer_default_round_rows); staged = the process's peer calls use IPC
  // staging (mok_jax._peer_ipc.active()), whose return rows are not in the
  // workspace.
  m.def("peer_forward_workspace_bytes", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs,
                                           int32_t ranks, int64_t round_rows, bool staged) -> size_t {
    const mok::Problem p = mok::bf16_problem(T, H, F, E, K, Fs);
    return mok::cuda::peer_forward_workspace_bytes(p, ranks, mok::peer_round_rows(p, ranks, round_rows), staged);
  });
  m.def("peer_backward_workspace_bytes", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs,
                                            int32_t ranks, int64_t round_rows, bool staged) -> size_t {
    const mok::Problem p = mok::bf16_problem(T, H, F, E, K, Fs);
    return mok::cuda::peer_backward_workspace_bytes(p, ranks, mok::peer_round_rows(p, ranks, round_rows), staged);
  });
  // The round size a peer call uses (round_rows 0 = the default): the kept
  // pre-activations are [peer_round_rows, F].
  m.def("peer_round_rows", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs, int32_t ranks,
                              int64_t round_rows) -> int64_t {
    return mok::peer_round_rows(mok::bf16_problem(T, H, F, E, K, Fs), ranks, round_rows);
  });
  // The multi-process peer path (peer_runtime.h; driven by mok_jax/_peer_ipc.py):
  // peer_staging_bytes(T_local, H, F, E, K, Fs), peer_ipc_export(ordinal,
  // global_id, staging_bytes) -> bytes, peer_ipc_import(bytes). Errors raise.
  m.def("peer_staging_bytes", [](int64_t T, int64_t H, int64_t F, int64_t E, int64_t K, int64_t Fs) -> size_t {
    return mok::cuda::peer_staging_bytes(mok::bf16_problem(T, H, F, E, K, Fs));
  });
  m.def("peer_ipc_export", [](int ordinal, int32_t global_id, size_t staging_bytes) {
    std::string blob;
    if (std::string e = mok::cuda::peer_ipc_export(ordinal, global_id, staging_bytes, &blob); !e.empty())
      throw std::runtime_error(e);
    return nanobind::bytes(blob.data(), blob.size());
  });
  m.def("peer_ipc_import", [](nanobind::bytes blob) {
    const std::string b(static_cast<const char*>(blob.data()), blob.size());
    if (std::string e = mok::cuda::peer_ipc_import(b); !e.empty()) throw std::runtime_error(e);
  });
  // peer_access_problem(ordinals) -> "" or why those GPUs of this process
  // cannot run the peer dispatch (no peer-to-peer between two of them).
  m.def("peer_access_problem", [](std::vector<int32_t> ordinals) { return mok::cuda::peer_access_problem(ordinals); });
  m.def("captured_calls", []() { return mok::g_captured_calls.load(); });
  // The compile-time variants of this build (mok_jax.info, the benchmark's metadata).
  m.def("build_options", []() {
    nanobind::dict d;
    d["gemm_tma_store"] = MOK_GEMM_TMA_STORE != 0;
    return d;
  });
}
