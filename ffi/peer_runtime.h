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
#include <vector>

#include "peer_forward.h"

namespace mok::cuda {

constexpr int kPeerGroupSlots = 16;

// The PeerGroup of `device` for this call: its rank and every rank's control
// block, from the call's device list (groups of `ranks`, rank-major).
// nullptr or an error message (static storage or the thread's last message).
const char* peer_group_for(int device, const std::vector<int32_t>& devices, int ranks, uint64_t timeout_ns,
                           PeerGroup* out);

}  // namespace mok::cuda
