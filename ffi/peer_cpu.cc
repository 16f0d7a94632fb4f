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
  float* ret = nullptr;        // [T*K, H] fp32 rows (expert outputs, or d_x rows), pushed by the experts' ranks
  const void* dy = nullptr;    // backward only
  const float* w = nullptr;    // backward only: topk_weights
  float* ret_dw = nullptr;     // backward only: [T*K] d_topk_weights
};

struct HostGroup {
  std::mutex m;
  std::condition_variable cv;
  std::vector<Slot> slots;
};

// One group per distinct device list, for the life of the process (the slots'
// counters must survive between calls, forward and backward alike).
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

// One call of one rank: join (publish + wait), then finish (signal + wait).
class Call {
 public:
  Call(const PeerCpuCall& call, int64_t experts) : call_(call) {
    if (call.ranks < 1 || experts % call.ranks != 0) {
      error_ = "peer dispatch: the number of experts must divide by the ranks";
      return;
    }
    size_t begin = 0;
    error_ = find_peer_rank(call.device, call.devices, call.ranks, &begin, &rank_);
    if (!error_.empty()) return;
    group_ = &host_group(std::vector<int32_t>(call.devices.begin() + begin, call.devices.begin() + begin + call.ranks));
    deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(call.timeout_ms);
  }
  const std::string& error() const { return error_; }
  int rank() const { return rank_; }

  // Publishes `mine`, waits for every rank; returns every rank's slot.
  std::string join(const Slot& mine, std::vector<Slot>* peers) {
    HostGroup& g = *group_;
    const int R = call_.ranks;
    std::unique_lock<std::mutex> lock(g.m);
    Slot& self = g.slots[rank_];
    const uint64_t gen = self.gen + 1, returns = self.returns;
    self = mine;
    self.gen = gen_ = gen;
    self.returns = returns;
    g.cv.notify_all();
    auto behind = [&] {
      std::vector<int> late;
      for (int s = 0; s < R; ++s)
        if (g.slots[s].gen < gen) late.push_back(s);
      return late;
    };
    if (!g.cv.wait_until(lock, deadline_, [&] { return behind().empty(); }))
      return "peer dispatch: rank " + std::to_string(rank_) + " waited " + std::to_string(call_.timeout_ms) +
             " ms for rank(s) " + list(behind()) + " to join call " + std::to_string(gen) + " (lost peer)";
    for (int s = 0; s < R; ++s)
      if (g.slots[s].gen > gen)  // a peer cannot finish call gen without this rank
        return "peer dispatch: rank " + std::to_string(s) + " is past call " + std::to_string(gen) + " of rank " +
               std::to_string(rank_) + " (ranks called a different number of times)";
    *peers = g.slots;
    return {};
  }

  // Tells every rank its rows are written (the lock orders the writes before
  // it), waits until every rank has written this rank's rows.
  std::string finish() {
    HostGroup& g = *group_;
    const int R = call_.ranks;
    std::unique_lock<std::mutex> lock(g.m);
    for (int s = 0; s < R; ++s) ++g.slots[s].returns;
    g.cv.notify_all();
    const uint64_t want = gen_ * static_cast<uint64_t>(R);
    if (!g.cv.wait_until(lock, deadline_, [&] { return g.slots[rank_].returns >= want; }))
      return "peer dispatch: rank " + std::to_string(rank_) + " waited " + std::to_string(call_.timeout_ms) +
             " ms for its rows to come back in call " + std::to_string(gen_) + " (lost peer)";
    return {};
  }

 private:
  PeerCpuCall call_;
  std::string error_;
  int rank_ = 0;
  HostGroup* group_ = nullptr;
  uint64_t gen_ = 0;
  std::chrono::steady_clock::time_point deadline_;
};

// The (owner, pair) of every row of local expert `e`, in global pair order.
std::vector<std::pair<int, int64_t>> expert_rows(const std::vector<Slot>& peers, int64_t pairs, int64_t K,
                                                 int32_t expert) {
  std::vector<std::pair<int, int64_t>> rows;
  for (int s = 0; s < static_cast<int>(peers.size()); ++s)
    for (int64_t q = 0; q < pairs; ++q)
      if (peers[s].mask[q / K] && peers[s].ids[q] == expert) rows.emplace_back(s, q);
  return rows;
}

// pair_row[q] = q for this rank's routable pairs, -1 for masked tokens and
// bad ids; the first bad id, if any, into *bad.
std::vector<int32_t> local_pairs(const Problem& p, const ForwardArgs& a, std::string* bad) {
  const int64_t P = p.tokens * p.top_k;
  std::vector<int32_t> pair_row(static_cast<size_t>(P), -1);
  for (int64_t q = 0; q < P; ++q) {
    if (!a.token_mask[q / p.top_k]) continue;
    const int32_t id = a.topk_ids[q];
    if (id < 0 || id >= p.experts) {
      if (bad->empty())
        *bad = "topk_ids: expert id " + std::to_string(id) + " is outside [0, " + std::to_string(p.experts) +
               ") (the pair was skipped by every rank)";
      continue;
    }
    pair_row[q] = static_cast<int32_t>(q);
  }
  return pair_row;
}

// The x rows (dy rows with `dy`) of `rows`, read from their owners, as fp32.
void load_owner_rows(const Problem& p, const std::vector<Slot>& peers, const std::vector<std::pair<int, int64_t>>& rows,
                     bool dy, float* dst) {
  const int64_t H = p.hidden;
  for (size_t i = 0; i < rows.size(); ++i) {
    const void* src = dy ? peers[rows[i].first].dy : peers[rows[i].first].x;
    const int64_t t = rows[i].second / p.top_k;
    for (int64_t h = 0; h < H; ++h) dst[i * H + h] = load_elem(p.dtype, src, t * H + h);
  }
}

// The shared expert's forward over this rank's tokens with its pre-activations
// in `scratch` (the peer calls keep no residuals): a.shared_*_pre point there
// afterwards. Returns its output rows (empty when Fs == 0).
std::vector<float> shared_forward_scratch(const Problem& p, ForwardArgs& a, std::vector<uint8_t>& scratch) {
  const size_t bytes = static_cast<size_t>(p.tokens * p.shared_ffn) * 4;  // fp32 at most
  scratch.resize(2 * bytes);
  a.shared_gate_pre = scratch.data();
  a.shared_up_pre = scratch.data() + bytes;
  return shared_expert_forward_cpu(p, a);
}

// Rounds v to the dtype, as a residual stored in it would be.
void round_to(DType dtype, std::vector<float>& v) {
  std::vector<uint8_t> tmp(v.size() * 4);
  from_f32(dtype, v.data(), tmp.data(), static_cast<int64_t>(v.size()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load_elem(dtype, tmp.data(), static_cast<int64_t>(i));
}

}  // namespace

std::string peer_forward_cpu(const Problem& p, const PeerCpuCall& pc, const ForwardArgs& a, const ParallelFor& pfor) {
  Call call(pc, p.experts);
  if (!call.error().empty()) return call.error();
  const int64_t T = p.tokens, K = p.top_k, H = p.hidden, F = p.ffn, El = p.experts / pc.ranks;
  const int64_t base = call.rank() * El;
  std::vector<float> ret(static_cast<size_t>(T * K * H), 0.0f);

  // 1. publish, wait for every rank
  Slot mine;
  mine.x = a.x, mine.ids = a.topk_ids, mine.mask = a.token_mask, mine.ret = ret.data();
  std::vector<Slot> peers;
  if (std::string e = call.join(mine, &peers); !e.empty()) return e;

  // 2. this rank's experts over every rank's pairs; each output row goes to
  //    its owner's return rows (a pair has one expert: disjoint writes).
  pfor(El, [&](int64_t e) {
    const auto rows = expert_rows(peers, T * K, K, static_cast<int32_t>(base + e));
    const int64_t n = static_cast<int64_t>(rows.size());
    if (n == 0) return;
    std::vector<float> xs(static_cast<size_t>(n * H)), gt(static_cast<size_t>(n * F)), up(gt.size()),
        act(gt.size()), out(static_cast<size_t>(n * H));
    load_owner_rows(p, peers, rows, false, xs.data());
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

  // 3. signal, wait for this rank's rows, 4. the local fixed-order combine
  if (std::string e = call.finish(); !e.empty()) return e;
  std::string bad;
  const std::vector<int32_t> pair_row = local_pairs(p, a, &bad);
  ForwardArgs sa = a;
  std::vector<uint8_t> scratch;
  const std::vector<float> shared = shared_forward_scratch(p, sa, scratch);
  combine_rows_cpu(p, a.topk_weights, pair_row.data(), ret.data(), shared.empty() ? nullptr : shared.data(), a.y);
  return bad;
}

std::string peer_backward_cpu(const Problem& p, const PeerCpuCall& pc, const BackwardArgs& a,
                              const ParallelFor& pfor) {
  Call call(pc, p.experts);
  if (!call.error().empty()) return call.error();
  const ForwardArgs& f = a.fwd;
  const int64_t T = p.tokens, K = p.top_k, H = p.hidden, F = p.ffn, El = p.experts / pc.ranks;
  const int64_t base = call.rank() * El;
  std::vector<float> ret(static_cast<size_t>(T * K * H), 0.0f), ret_dw(static_cast<size_t>(T * K), 0.0f);

  Slot mine;
  mine.x = f.x, mine.ids = f.topk_ids, mine.mask = f.token_mask, mine.ret = ret.data();
  mine.dy = a.dy, mine.w = f.topk_weights, mine.ret_dw = ret_dw.data();
  std::vector<Slot> peers;
  if (std::string e = call.join(mine, &peers); !e.empty()) return e;

  // Each local expert over every rank's rows (the forward recomputed: nothing
  // was kept); its weight gradients sum over all its rows at once, in global
  // pair order, so they are the EP = 1 gradients.
  pfor(El, [&](int64_t e) {
    const auto rows = expert_rows(peers, T * K, K, static_cast<int32_t>(base + e));
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<float> dwg(static_cast<size_t>(H * F), 0.0f), dwu(dwg.size(), 0.0f), dwd(dwg.size(), 0.0f);
    if (n > 0) {
      SegmentBuffers b;
      b.resize(n, H, F);
      std::vector<float> scale(static_cast<size_t>(n)), dscale(static_cast<size_t>(n));
      load_owner_rows(p, peers, rows, false, b.xs.data());
      load_owner_rows(p, peers, rows, true, b.dyr.data());
      for (int64_t i = 0; i < n; ++i) scale[i] = peers[rows[i].first].w[rows[i].second];
      const F32Slice wg(p.dtype, f.w_gate, e * H * F, H * F), wu(p.dtype, f.w_up, e * H * F, H * F),
          wd(p.dtype, f.w_down, e * F * H, F * H);
      gemm_nn(n, F, H, b.xs.data(), H, wg.data(), F, b.g.data(), F, false);
      gemm_nn(n, F, H, b.xs.data(), H, wu.data(), F, b.u.data(), F, false);
      round_to(p.dtype, b.g);
      round_to(p.dtype, b.u);
      ffn_backward(p, n, F, scale.data(), b, wg.data(), wu.data(), wd.data(), dwg.data(), dwu.data(), dwd.data(),
                   dscale.data());
      for (int64_t i = 0; i < n; ++i) {
        const Slot& owner = peers[rows[i].first];
        const int64_t q = rows[i].second;
        owner.ret_dw[q] = dscale[i];
        for (int64_t h = 0; h < H; ++h) owner.ret[q * H + h] = b.dxs[i * H + h];
      }
    }
    from_f32(p.dtype, dwg.data(), elem_ptr(p.dtype, a.dw_gate, e * H * F), H * F);
    from_f32(p.dtype, dwu.data(), elem_ptr(p.dtype, a.dw_up, e * H * F), H * F);
    from_f32(p.dtype, dwd.data(), elem_ptr(p.dtype, a.dw_down, e * F * H), F * H);
  });

  if (std::string e = call.finish(); !e.empty()) return e;
  std::string bad;
  const std::vector<int32_t> pair_row = local_pairs(p, f, &bad);
  for (int64_t q = 0; q < T * K; ++q) a.d_topk_weights[q] = pair_row[q] >= 0 ? ret_dw[q] : 0.0f;
  // The shared expert over this rank's tokens: its pre-activations recomputed.
  BackwardArgs sb = a;
  std::vector<uint8_t> scratch;
  shared_forward_scratch(p, sb.fwd, scratch);
  const std::vector<float> dx_shared = shared_expert_backward_cpu(p, sb);
  combine_rows_cpu(p, nullptr, pair_row.data(), ret.data(), dx_shared.empty() ? nullptr : dx_shared.data(), a.dx);
  return bad;
}

}  // namespace mok
