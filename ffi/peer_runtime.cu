// Control-block pools, peer access and kernel preload of the CUDA peer
// dispatch (see peer_runtime.h).
#include "peer_runtime.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "peer_backward.h"
#include "peer_rank.h"

namespace mok::cuda {
namespace {

struct Runtime {
  bool ready = false;
  std::string error;                        // sticky: a failed init fails every call
  std::vector<PeerControl*> pool;           // [device * kPeerGroupSlots + slot]
  std::map<std::vector<int32_t>, int> slot;  // group device list -> slot
  int next_slot = 0;
};

std::mutex g_mutex;
Runtime g_rt;

// Runs one solo peer forward and backward with a shared expert on the
// current device, in rounds of 128 rows (so the several-rounds kernels run
// too), so every kernel of the path gets loaded there (init-time only).
std::string preload(PeerControl* solo) {
  Problem p;
  p.tokens = 16, p.hidden = 128, p.ffn = 128, p.experts = 2, p.top_k = 1, p.shared_ffn = 128;
  p.dtype = DType::kBF16;
  const int64_t C = 128;
  const size_t ws_bytes = std::max(peer_forward_workspace_bytes(p, 1, C), peer_backward_workspace_bytes(p, 1, C));
  constexpr size_t kSlot = 65536;  // every tensor of the tiny problem fits
  const size_t total = ws_bytes + 16 * kSlot;
  uint8_t* mem = nullptr;
  if (ws_bytes == 0 || cudaMalloc(&mem, total) != cudaSuccess) return "cannot allocate the preload buffers";
  std::string err;
  cudaStream_t s = nullptr;
  if (cudaMemset(mem, 0, total) != cudaSuccess || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    err = "cannot set up the preload";
  } else {
    uint8_t* at = mem + ws_bytes;
    auto take = [&] { uint8_t* q = at; at += kSlot; return q; };
    PeerForwardArgs a{};
    a.x = take();
    a.topk_ids = reinterpret_cast<const int32_t*>(take());  // zeros: expert 0
    a.topk_weights = reinterpret_cast<const float*>(take());
    a.token_mask = take();
    a.w_gate = take(), a.w_up = take(), a.w_down = take();
    a.ws_gate = take(), a.ws_up = take(), a.ws_down = take();
    a.y = take();
    PeerBackwardArgs b{};
    b.dy = a.y, b.fwd = a, b.dx = take(), b.d_topk_weights = reinterpret_cast<float*>(take());
    b.dw_gate = take(), b.dw_up = take(), b.dw_down = take();
    b.dws_gate = take(), b.dws_up = take(), b.dws_down = mem + ws_bytes + 15 * kSlot;
    PeerGroup g;
    g.ctl[0] = solo;
    if (const char* e = peer_forward(p, g, a, mem, C, s)) err = e;
    else if (const char* e2 = peer_backward(p, g, b, mem, C, s)) err = e2;
    else if (cudaStreamSynchronize(s) != cudaSuccess) err = cudaGetErrorString(cudaGetLastError());
  }
  if (s) cudaStreamDestroy(s);
  cudaFree(mem);
  return err;
}

std::string init_locked() {
  int count = 0, current = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || cudaGetDevice(&current) != cudaSuccess)
    return "cannot enumerate the GPUs";
  g_rt.pool.assign(static_cast<size_t>(count) * kPeerGroupSlots, nullptr);
  std::string err;
  for (int d = 0; d < count && err.empty(); ++d) {
    if (cudaSetDevice(d) != cudaSuccess) { err = "cannot select GPU " + std::to_string(d); break; }
    PeerControl* blocks = nullptr;
    const size_t bytes = sizeof(PeerControl) * (kPeerGroupSlots + 1);  // + one for the preload
    if (cudaMalloc(&blocks, bytes) != cudaSuccess || cudaMemset(blocks, 0, bytes) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      err = "cannot allocate the control blocks on GPU " + std::to_string(d);
      break;
    }
    for (int s = 0; s < kPeerGroupSlots; ++s) g_rt.pool[d * kPeerGroupSlots + s] = blocks + s;
    for (int q = 0; q < count; ++q) {
      int can = 0;
      if (q == d || cudaDeviceCanAccessPeer(&can, d, q) != cudaSuccess || !can) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(q, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // clear it: not an error
      else if (e != cudaSuccess) err = "cannot enable peer access from GPU " + std::to_string(d) + " to " + std::to_string(q);
    }
    if (err.empty()) {
      const std::string e = preload(blocks + kPeerGroupSlots);
      if (!e.empty()) err = "preloading the peer kernels on GPU " + std::to_string(d) + " failed: " + e;
    }
  }
  cudaSetDevice(current);
  return err;
}

}  // namespace

const char* peer_group_for(int device, const std::vector<int32_t>& devices, int ranks, uint64_t timeout_ns,
                           PeerGroup* out) {
  thread_local std::string message;
  if (ranks < 1 || ranks > kMaxPeerRanks) return "peer dispatch: ranks must be in [1, 8]";
  size_t begin = 0;
  int rank = 0;
  message = find_peer_rank(device, devices, ranks, &begin, &rank);
  if (!message.empty()) return message.c_str();
  const std::vector<int32_t> group(devices.begin() + begin, devices.begin() + begin + ranks);

  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_rt.ready && g_rt.error.empty()) {
    g_rt.error = init_locked();
    g_rt.ready = g_rt.error.empty();
  }
  if (!g_rt.ready) {
    message = "peer dispatch: " + g_rt.error;
    return message.c_str();
  }
  const int n_dev = static_cast<int>(g_rt.pool.size() / kPeerGroupSlots);
  for (int32_t d : group)
    if (d < 0 || d >= n_dev) {
      message = "peer dispatch: device " + std::to_string(d) + " is not a visible GPU";
      return message.c_str();
    }
  auto it = g_rt.slot.find(group);
  if (it == g_rt.slot.end()) {
    if (g_rt.next_slot == kPeerGroupSlots) {
      message = "peer dispatch: more than " + std::to_string(kPeerGroupSlots) +
                " distinct device groups in one process";
      return message.c_str();
    }
    it = g_rt.slot.emplace(group, g_rt.next_slot++).first;
  }
  PeerGroup g;
  for (int s = 0; s < ranks; ++s) g.ctl[s] = g_rt.pool[group[s] * kPeerGroupSlots + it->second];
  g.rank = rank;
  g.ranks = ranks;
  g.timeout_ns = timeout_ns;
  *out = g;
  return nullptr;
}

}  // namespace mok::cuda
