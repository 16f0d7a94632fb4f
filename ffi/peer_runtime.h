// The library-owned side of the CUDA peer dispatch in one process: the
// control blocks (peer_forward.h) every rank publishes to and its peers
// poll, peer access between the GPUs, and the kernel preload.
//
// On the first peer call of the process, under one lock and before any
// spinning kernel exists, every visible GPU gets:
//   - a pool of kPeerGroupSlots zeroed PeerControl blocks (cudaMalloc once;
//     never freed, never touched by XLA), one per (group, device);
//   - peer access to every other GPU it can reach (XLA usually enabled it
//     already; "already enabled" is not an error);
//   - one solo (ranks = 1) peer forward on a tiny problem, synchronised, so
//     every kernel of the path is loaded: with lazy module loading a first
//     launch waits for the device to idle, which a rank spinning on a peer
//     never does (the deadlock the virtual-rank test hit).
// A group (one expert-axis device list) then takes the next free slot on
// its devices: later groups need no CUDA call, so no host allocation ever
// waits behind a spinning kernel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "peer_forward.h"

namespace mok::cuda {

constexpr int kPeerGroupSlots = 16;

// The PeerGroup of `device` for this call: its rank and every rank's control
// block, from the call's device list (groups of `ranks`, rank-major).
// nullptr or an error message (static storage or the thread's last message).
const char* peer_group_for(int device, const std::vector<int32_t>& devices, int ranks, uint64_t timeout_ns,
                           PeerGroup* out);

// "" when every GPU of `ordinals` (CUDA ordinals of this process) can read
// every other one's memory, else why not (no peer-to-peer between a pair).
// dispatch="auto" asks it before it picks "peer"; a one-process peer call
// refuses a group that fails it.
std::string peer_access_problem(const std::vector<int32_t>& ordinals);

// Several processes (CUDA IPC; mok_jax/_peer_ipc.py drives these at trace
// time, before any call of the mesh runs, and swaps the blobs through the
// jax.distributed key-value store). From the first export on, the process's
// peer calls name devices by global id.
//
// peer_ipc_export: sets up GPU `ordinal` (global id `global_id`) if needed,
// grows its staging buffer to at least `staging_bytes` (never shrunk; a
// replaced buffer stays allocated, calls already queued may still use it),
// and returns in *blob what another process needs to map its control blocks
// and staging. "" or why not.
std::string peer_ipc_export(int ordinal, int32_t global_id, size_t staging_bytes, std::string* blob);
// Maps another process's exported device (a blob of peer_ipc_export; one of
// this process is recognised and skipped). "" or why not.
std::string peer_ipc_import(const std::string& blob);

}  // namespace mok::cuda
