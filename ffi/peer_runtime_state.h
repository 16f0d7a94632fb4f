// The process-wide state of the CUDA peer dispatch, shared by peer_runtime.cu
// (control blocks, kernel preload, group lookup) and peer_ipc.cu (the
// multi-process side). Every access holds peer_state_mutex().
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "peer_forward.h"
#include "peer_runtime.h"

namespace mok::cuda::detail {

// A rank of another process, mapped here through CUDA IPC.
struct RemoteRank {
  PeerControl* pool = nullptr;  // its device's control blocks, [kPeerGroupSlots + 1]
  int64_t delta = 0;            // our mapping of its staging minus its own address of it
};

struct PeerState {
  bool all_ready = false;          // one process: every visible GPU set up on the first call
  std::string error;               // sticky: a failed set-up fails every later call
  std::vector<PeerControl*> pool;  // [device * kPeerGroupSlots + slot]; nullptr: device not set up
  std::map<std::vector<int32_t>, int> slot;  // group device list -> slot
  int next_slot = 0;
  // Several processes (peer_ipc.cu): device lists hold global device ids.
  bool ipc = false;
  std::map<int32_t, int> local_ordinal;           // global id -> CUDA ordinal, this process's devices
  std::map<int, std::pair<uint8_t*, size_t>> staging;  // ordinal -> IPC-exported staging buffer
  std::map<int32_t, RemoteRank> remote;           // global id -> a rank of another process
  std::map<std::string, void*> opened;            // IPC handle bytes -> our mapping (opened once)
};

std::mutex& peer_state_mutex();
PeerState& peer_state();
// Sets up GPU `device` (its control blocks, peer access to the others, the
// kernel preload) unless it already is; "" or why not. Holds the mutex.
std::string set_up_device_locked(int device);

}  // namespace mok::cuda::detail
