// The CPU "peer" dispatch (protocol in peer_cpu.h).
#include "peer_cpu.h"

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>

#include "combine.h"
#include "dtype.h"
#include "forward_cpu.h"
#include "gemm.h"
#include "swiglu.h"

namespace mok {
namespace {

struct Slot {
  uint64_t gen = 0;      // calls published by this rank
  uint64_t returns = 0;  // return signals received, `ranks` per call
  const void* x = nullptr;
  const int32_t* ids = nullptr;
  const uint8_t* mask = nullptr;
  float* ret = nullptr;  // [T*K, H] expert output rows, pushed by the experts' ranks
};

struct HostGroup {
  std::mutex m;
  std::condition_variable cv;
  std::vector<Slot> slots;
};

// One group per distinct device list, for the life of the process (the slots'
// counters must survive between calls).
HostGroup& host_group(const std::vector<int32_t>& devices) {
  static std::mutex registry_mutex;
  static std::map<std::vector<int32_t>, std::unique_ptr<HostGroup>> registry;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& g = registry[devices];
  if (!g) {
    g = std::make_unique<HostGroup>();
    g->slots.resize(devices.size());
  }
  return *g;
}

std::string list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

std::string peer_forward_cpu(const Problem& p, const PeerCpuCall& call, const ForwardArgs& a,
                             const ParallelFor& pfor) {
  const int R = call.ranks;
  if (R < 1 || p.experts % R != 0) return "peer dispatch: the number of experts must divide by the ranks";
  size_t begin = 0;
  int rank = 0;
  if (std::string e = find_peer_rank(call.device, call.devices, R, &begin, &rank); !e.empty()) return e;
  HostGroup& g = host_group(std::vector<int32_t>(call.devices.begin() + begin, call.devices.begin() + begin + R));

  const int64_t T = p.tokens, K = p.top_k, H = p.hidden, F = p.ffn, E = p.experts, El = E / R;
  const int64_t base = rank * El;
  std::vector<float> ret(static_cast<size_t>(T * K * H), 0.0f);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(call.timeout_ms);

  // 1. publish, wait for every rank
  std::vector<Slot> peers;
  uint64_t gen = 0;
  {
    std::unique_lock<std::mutex> lock(g.m);
    Slot& self = g.slots[rank];
    self.x = a.x, self.ids = a.topk_ids, self.mask = a.token_mask, self.ret = ret.data();
    gen = ++self.gen;
    g.cv.notify_all();
    auto behind = [&] {
      std::vector<int> late;
      for (int s = 0; s < R; ++s)
        if (g.slots[s].gen < gen) late.push_back(s);
      return late;
    };
    if (!g.cv.wait_until(lock, deadline, [&] { return behind().empty(); }))
      return "peer dispatch: rank " + std::to_string(rank) + " waited " + std::to_string(call.timeout_ms) +
             " ms for rank(s) " + list(behind()) + " to join call " + std::to_string(gen) + " (lost peer)";
    for (int s = 0; s < R; ++s)
      if (g.slots[s].gen > gen)  // a peer cannot finish call gen without this rank
        return "peer dispatch: rank " + std::to_string(s) + " is past call " + std::to_string(gen) +
               " of rank " + std::to_string(rank) + " (ranks called a different number of times)";
    peers = g.slots;
  }

  // 2. this rank's experts over every rank's pairs (global pair order); each
  //    output row goes to its owner's return buffer. A pair has one expert, so
  //    the experts' writes are disjoint.
  pfor(El, [&](int64_t e) {
    std::vector<std::pair<int, int64_t>> rows;  // (owner, pair)
    for (int s = 0; s < R; ++s)
      for (int64_t q = 0; q < T * K; ++q)
        if (peers[s].mask[q / K] && peers[s].ids[q] == base + e) rows.emplace_back(s, q);
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) return;
    std::vector<float> xs(static_cast<size_t>(n * H)), gt(static_cast<size_t>(n * F)), up(gt.size()),
        act(gt.size()), out(static_cast<size_t>(n * H));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = rows[i].second / K;
      for (int64_t h = 0; h < H; ++h) xs[i * H + h] = load_elem(p.dtype, peers[rows[i].first].x, t * H + h);
    }
    const F32Slice wg(p.dtype, a.w_gate, e * H * F, H * F), wu(p.dtype, a.w_up, e * H * F, H * F),
        wd(p.dtype, a.w_down, e * F * H, F * H);
    gemm_nn(n, F, H, xs.data(), H, wg.data(), F, gt.data(), F, false);
    gemm_nn(n, F, H, xs.data(), H, wu.data(), F, up.data(), F, false);
    swiglu_forward_cpu(p.dtype, n * F, gt.data(), up.data(), act.data());
    gemm_nn(n, H, F, act.data(), F, wd.data(), H, out.data(), H, false);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = peers[rows[i].first].ret + rows[i].second * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = out[i * H + h];
    }
  });

  // 3. signal every rank (the lock orders the row writes before it), wait for ours
  {
    std::unique_lock<std::mutex> lock(g.m);
    for (int s = 0; s < R; ++s) ++g.slots[s].returns;
    g.cv.notify_all();
    const uint64_t want = gen * static_cast<uint64_t>(R);
    if (!g.cv.wait_until(lock, deadline, [&] { return g.slots[rank].returns >= want; }))
      return "peer dispatch: rank " + std::to_string(rank) + " waited " + std::to_string(call.timeout_ms) +
             " ms for its rows to come back in call " + std::to_string(gen) + " (lost peer)";
  }

  // 4. the local fixed-order combine
  std::vector<int32_t> pair_row(static_cast<size_t>(T * K), -1);
  int32_t bad_id = 0;
  bool bad = false;
  for (int64_t q = 0; q < T * K; ++q) {
    if (!a.token_mask[q / K]) continue;
    const int32_t id = a.topk_ids[q];
    if (id < 0 || id >= E) {
      if (!bad) bad_id = id;
      bad = true;
      continue;
    }
    pair_row[q] = static_cast<int32_t>(q);
  }
  const int64_t Fs = p.shared_ffn;
  std::vector<uint8_t> s_gate(static_cast<size_t>(T * Fs * 4)), s_up(s_gate.size());
  ForwardArgs sa = a;
  sa.shared_gate_pre = s_gate.data();
  sa.shared_up_pre = s_up.data();
  const std::vector<float> shared = shared_expert_forward_cpu(p, sa);
  combine_rows_cpu(p, a.topk_weights, pair_row.data(), ret.data(), shared.empty() ? nullptr : shared.data(), a.y);
  if (bad)
    return "topk_ids: expert id " + std::to_string(bad_id) + " is outside [0, " + std::to_string(E) +
           ") (the pair was skipped by every rank)";
  return {};
}

}  // namespace mok
