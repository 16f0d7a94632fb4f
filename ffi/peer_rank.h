// Which rank of which expert-axis group a device is, from the device list an
// FFI peer call carries (every group's device ordinals, rank-major). Shared
// by the CPU and CUDA peer handlers: SPMD programs are traced once for all
// ranks, so a device learns its rank here, at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mok {

// Sets *group_begin (index of the group's rank 0 in `devices`) and *rank, or
// returns an error.
inline std::string find_peer_rank(int32_t device, const std::vector<int32_t>& devices, int ranks,
                                  size_t* group_begin, int* rank) {
  if (ranks < 1 || devices.empty() || devices.size() % static_cast<size_t>(ranks) != 0)
    return "peer dispatch: the device list does not split into groups of " + std::to_string(ranks);
  for (size_t i = 0; i < devices.size(); ++i)
    if (devices[i] == device) {
      *group_begin = i / ranks * ranks;
      *rank = static_cast<int>(i % ranks);
      return {};
    }
  return "peer dispatch: device " + std::to_string(device) + " is not in the call's device list";
}

}  // namespace mok
