// The multi-process side of the CUDA peer dispatch (peer_runtime.h): each
// process exports its devices' control blocks and staging buffers as CUDA
// IPC handles, and maps those of the other processes' devices.
//
// Why a staging buffer: the addresses XLA gives a call are private to its
// process (and change every call), so a rank cannot publish them to another
// process. Each rank copies its inputs into its own exported staging buffer
// and receives its return rows there (peer_forward.h: stage_peer_buffers);
// a peer turns the published addresses into its own mapping by adding
// PeerGroup::delta. The control blocks are exported once: their generation
// counters must live as long as the process.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "peer_runtime.h"
#include "peer_runtime_state.h"

namespace mok::cuda {
namespace {

constexpr uint32_t kBlobMagic = 0x4d4f4b49;  // "MOKI"

// What one exported device tells the other processes.
struct IpcBlob {
  uint32_t magic;
  int32_t pid;        // the exporting process (a blob of our own is skipped)
  int32_t global_id;
  int32_t pad;
  cudaIpcMemHandle_t pool, staging;
  uint64_t staging_address;  // the exporter's own address of its staging
  uint64_t staging_bytes;
};

std::string cuda_error(const char* what, cudaError_t e) {
  cudaGetLastError();  // clear it: the error is reported, the context stays usable
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// Our mapping of an exported allocation, opened once per handle.
std::string open_handle(detail::PeerState& st, const cudaIpcMemHandle_t& h, void** mapped) {
  const std::string key(reinterpret_cast<const char*>(&h), sizeof(h));
  if (auto it = st.opened.find(key); it != st.opened.end()) {
    *mapped = it->second;
    return {};
  }
  if (const cudaError_t e = cudaIpcOpenMemHandle(mapped, h, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
    return cuda_error("cudaIpcOpenMemHandle", e);
  st.opened.emplace(key, *mapped);
  return {};
}

}  // namespace

std::string peer_ipc_export(int ordinal, int32_t global_id, size_t staging_bytes, std::string* blob) {
  std::lock_guard<std::mutex> lock(detail::peer_state_mutex());
  detail::PeerState& st = detail::peer_state();
  if (st.all_ready && !st.ipc)
    return "peer dispatch: this process already ran single-process peer calls; the multi-process path needs "
           "every peer call of the process to use it";
  st.ipc = true;
  if (std::string e = detail::set_up_device_locked(ordinal); !e.empty()) return e;
  if (auto it = st.local_ordinal.find(global_id); it != st.local_ordinal.end() && it->second != ordinal)
    return "peer dispatch: global device id " + std::to_string(global_id) + " registered twice";
  st.local_ordinal[global_id] = ordinal;
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(ordinal) != cudaSuccess)
    return "peer dispatch: cannot select GPU " + std::to_string(ordinal);
  std::string err;
  auto& [base, bytes] = st.staging[ordinal];
  if (bytes < staging_bytes) {
    uint8_t* grown = nullptr;
    const size_t want = std::max(staging_bytes, 2 * bytes);
    if (const cudaError_t e = cudaMalloc(&grown, want); e != cudaSuccess) {
      err = cuda_error("peer dispatch: cannot allocate the IPC staging buffer", e);
    } else {
      base = grown, bytes = want;  // the old buffer stays: calls already queued may use it
    }
  }
  IpcBlob b{};
  b.magic = kBlobMagic;
  b.pid = static_cast<int32_t>(getpid());
  b.global_id = global_id;
  b.staging_address = reinterpret_cast<uint64_t>(base);
  b.staging_bytes = bytes;
  if (err.empty()) {
    if (const cudaError_t e = cudaIpcGetMemHandle(&b.pool, st.pool[ordinal * kPeerGroupSlots]); e != cudaSuccess)
      err = cuda_error("peer dispatch: cudaIpcGetMemHandle (control blocks)", e);
    else if (const cudaError_t e2 = cudaIpcGetMemHandle(&b.staging, base); e2 != cudaSuccess)
      err = cuda_error("peer dispatch: cudaIpcGetMemHandle (staging)", e2);
  }
  cudaSetDevice(current);
  if (err.empty()) blob->assign(reinterpret_cast<const char*>(&b), sizeof(b));
  return err;
}

std::string peer_ipc_import(const std::string& blob) {
  IpcBlob b{};
  if (blob.size() != sizeof(b)) return "peer dispatch: an IPC blob of the wrong size";
  std::memcpy(&b, blob.data(), sizeof(b));
  if (b.magic != kBlobMagic) return "peer dispatch: not a mok_jax IPC blob";
  if (b.pid == static_cast<int32_t>(getpid())) return {};  // a device of this process
  std::lock_guard<std::mutex> lock(detail::peer_state_mutex());
  detail::PeerState& st = detail::peer_state();
  if (st.local_ordinal.empty())
    return "peer dispatch: export this process's devices before importing the others'";
  // Map on one of our devices: with unified addressing the mapping serves
  // every device of the process (peer access enabled lazily as needed).
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess || cudaSetDevice(st.local_ordinal.begin()->second) != cudaSuccess)
    return "peer dispatch: cannot select a GPU for the IPC mappings";
  void *pool = nullptr, *staging = nullptr;
  std::string err = open_handle(st, b.pool, &pool);
  if (err.empty()) err = open_handle(st, b.staging, &staging);
  cudaSetDevice(current);
  if (!err.empty()) return "peer dispatch: mapping device " + std::to_string(b.global_id) + ": " + err;
  detail::RemoteRank& r = st.remote[b.global_id];
  r.pool = static_cast<PeerControl*>(pool);
  r.delta = static_cast<int64_t>(reinterpret_cast<uint64_t>(staging) - b.staging_address);
  return {};
}

}  // namespace mok::cuda
