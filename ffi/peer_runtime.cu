// Control-block pools, peer access, kernel preload and the group lookup of
// the CUDA peer dispatch (see peer_runtime.h).
#include "peer_runtime.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "peer_backward.h"
#include "peer_rank.h"
#include "peer_runtime_state.h"

namespace mok::cuda {
namespace {

// Runs one solo peer forward and backward with a shared expert on the
// current device, in rounds of 128 rows (so the several-rounds kernels run
// too), so every kernel of the path gets loaded there (set-up time only).
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

}  // namespace

std::string peer_access_problem(const std::vector<int32_t>& ordinals) {
  for (const int32_t d : ordinals)
    for (const int32_t q : ordinals) {
      int can = 0;
      if (d == q) continue;
      if (cudaDeviceCanAccessPeer(&can, d, q) != cudaSuccess) {
        cudaGetLastError();
        return "peer dispatch: cannot ask whether GPU " + std::to_string(d) + " reaches GPU " + std::to_string(q);
      }
      if (!can)
        return "peer dispatch: GPU " + std::to_string(d) + " cannot access GPU " + std::to_string(q) +
               "'s memory (no NVLink or PCIe peer-to-peer between them); use dispatch='collective'";
    }
  return {};
}

namespace detail {

std::mutex& peer_state_mutex() {
  static std::mutex m;
  return m;
}

PeerState& peer_state() {
  static PeerState s;
  return s;
}

std::string set_up_device_locked(int d) {
  PeerState& st = peer_state();
  int count = 0, current = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || cudaGetDevice(&current) != cudaSuccess)
    return "cannot enumerate the GPUs";
  if (st.pool.empty()) st.pool.assign(static_cast<size_t>(count) * kPeerGroupSlots, nullptr);
  if (d < 0 || d >= count) return "device " + std::to_string(d) + " is not a visible GPU";
  if (st.pool[d * kPeerGroupSlots] != nullptr) return {};
  std::string err;
  PeerControl* blocks = nullptr;
  const size_t bytes = sizeof(PeerControl) * (kPeerGroupSlots + 1);  // + one for the preload
  if (cudaSetDevice(d) != cudaSuccess) {
    err = "cannot select GPU " + std::to_string(d);
  } else if (cudaMalloc(&blocks, bytes) != cudaSuccess || cudaMemset(blocks, 0, bytes) != cudaSuccess ||
             cudaDeviceSynchronize() != cudaSuccess) {
    err = "cannot allocate the control blocks on GPU " + std::to_string(d);
  } else {
    for (int q = 0; q < count && err.empty(); ++q) {
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
    if (err.empty())
      for (int s = 0; s < kPeerGroupSlots; ++s) st.pool[d * kPeerGroupSlots + s] = blocks + s;
  }
  cudaSetDevice(current);
  return err;
}

}  // namespace detail

const char* peer_group_for(int device, const std::vector<int32_t>& devices, int ranks, uint64_t timeout_ns,
                           PeerGroup* out) {
  thread_local std::string message;
  if (ranks < 1 || ranks > kMaxPeerRanks) return "peer dispatch: ranks must be in [1, 8]";
  std::lock_guard<std::mutex> lock(detail::peer_state_mutex());
  detail::PeerState& st = detail::peer_state();
  // One process: the list holds CUDA ordinals, and every visible GPU is set
  // up on the first call, before any spinning kernel exists. Several
  // processes: global device ids, each set up when mok_jax registered it.
  int32_t me = device;
  if (st.ipc) {
    me = -1;
    for (const auto& [id, ordinal] : st.local_ordinal)
      if (ordinal == device) me = id;
    if (me < 0) {
      message = "peer dispatch: GPU " + std::to_string(device) +
                " was not registered for the multi-process peer path (mok_jax registers the mesh when it traces "
                "the call)";
      return message.c_str();
    }
  } else if (!st.all_ready && st.error.empty()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) st.error = "cannot enumerate the GPUs";
    for (int d = 0; d < count && st.error.empty(); ++d) st.error = detail::set_up_device_locked(d);
    st.all_ready = st.error.empty();
  }
  if (!st.error.empty()) {
    message = "peer dispatch: " + st.error;
    return message.c_str();
  }
  size_t begin = 0;
  int rank = 0;
  message = find_peer_rank(me, devices, ranks, &begin, &rank);
  if (!message.empty()) return message.c_str();
  const std::vector<int32_t> group(devices.begin() + begin, devices.begin() + begin + ranks);

  // Every rank of a group takes the same slot: groups are first used in the
  // same order everywhere (the same SPMD program), in every process too.
  auto it = st.slot.find(group);
  if (it == st.slot.end()) {
    if (!st.ipc) {
      // Set-up only enables the peer access a pair can have: a group of GPUs
      // without it (no NVLink or PCIe P2P between two of them) would fault
      // on the first pull, so refuse it once, when the group first comes.
      message = peer_access_problem(group);
      if (!message.empty()) return message.c_str();
    }
    if (st.next_slot == kPeerGroupSlots) {
      message = "peer dispatch: more than " + std::to_string(kPeerGroupSlots) + " distinct device groups in one process";
      return message.c_str();
    }
    it = st.slot.emplace(group, st.next_slot++).first;
  }
  PeerGroup g;
  for (int s = 0; s < ranks; ++s) {
    const int32_t d = group[s];
    int ordinal = -1;
    if (!st.ipc) {
      ordinal = d;
    } else if (auto l = st.local_ordinal.find(d); l != st.local_ordinal.end()) {
      ordinal = l->second;
    } else if (auto r = st.remote.find(d); r != st.remote.end()) {
      g.ctl[s] = r->second.pool + it->second;
      g.delta[s] = r->second.delta;
      continue;
    } else {
      message = "peer dispatch: device " + std::to_string(d) + " of the group has no IPC registration";
      return message.c_str();
    }
    if (ordinal < 0 || static_cast<size_t>(ordinal + 1) * kPeerGroupSlots > st.pool.size() ||
        st.pool[ordinal * kPeerGroupSlots] == nullptr) {
      message = "peer dispatch: device " + std::to_string(d) + " is not a visible GPU";
      return message.c_str();
    }
    g.ctl[s] = st.pool[ordinal * kPeerGroupSlots + it->second];
  }
  if (st.ipc) {
    auto sg = st.staging.find(device);
    if (sg == st.staging.end()) {
      message = "peer dispatch: GPU " + std::to_string(device) + " has no IPC staging buffer";
      return message.c_str();
    }
    g.staging = sg->second.first;
    g.staging_bytes = sg->second.second;
  }
  g.rank = rank;
  g.ranks = ranks;
  g.timeout_ns = timeout_ns;
  *out = g;
  return nullptr;
}

}  // namespace mok::cuda
