// Standalone test + benchmark of mok::cuda::backward (no JAX, no XLA).
//
//   backward_standalone [--correctness] [--small] [--case NAME] [--timing] [--timing-shared] [--iters N]
//                       [--no-check]   (timing: skip the sampled check afterwards, for A/B loops)
//                       [--shape T,H,F,E,K] (timing shape; default benchmark shape 1)
//                       [--megakernel] (correctness: every case also through the backward
//                                       megakernel, whose gradients must equal the staged ones
//                                       bitwise; timing: the megakernel is timed)
//
// Residuals come from mok::cuda::forward (validated by forward_standalone).
// Correctness: random bf16 inputs and dy (never zeros); every backward output and
// the workspace poisoned with 0xFF bytes before each run; all gradients compared
// with a CPU fp64 reference built from the same residuals (cosine >= 0.9999 and
// relative L2 <= 1e-2 per gradient); exact zeros for empty experts' weight
// gradients, masked tokens' dx and unrouted pairs' d_topk_weights; bitwise
// determinism over two runs.
// Timing: (T,H,F,E,K) = (32768,2048,768,128,8), median of N iterations after
// warm-up, CUDA events per stage; useful FLOPs = 2 * 6*T*K*H*F.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../../ffi/backward_cuda.h"
#include "../../ffi/forward_cuda.h"
#include "../../ffi/gemm_wgmma.cuh"
#include "../../ffi/megakernel_bwd.cuh"

using mok::BackwardArgs;
using mok::DType;
using mok::ForwardArgs;
using mok::Problem;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #x);                                                          \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

static inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
static inline double bf2d(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static inline float unif(uint64_t& s) {  // (-1, 1), never exactly 0
  const double u = ((splitmix(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  return static_cast<float>(2.0 * u - 1.0);
}
static unsigned nthreads() { return std::max(1u, std::min(32u, std::thread::hardware_concurrency())); }

static void fill_bf16(std::vector<uint16_t>& v, size_t n, float scale, uint64_t seed) {
  v.resize(n);
  const unsigned nt = nthreads();
  std::vector<std::thread> th;
  const size_t chunk = (n + nt - 1) / nt;
  for (unsigned i = 0; i < nt; ++i) {
    th.emplace_back([&, i] {
      uint64_t s = seed * 1000003ull + i * 7919ull + 1;
      const size_t b = i * chunk, e = std::min(n, b + chunk);
      for (size_t j = b; j < e; ++j) {
        uint16_t h = f2bf(unif(s) * scale);
        if ((h & 0x7fff) == 0) h = f2bf(scale * 1e-3f);
        v[j] = h;
      }
    });
  }
  for (auto& t : th) t.join();
}

enum class Routing { kUniform, kOneExpert, kSubset, kAllExperts, kBadIds };

struct Case {
  const char* name;
  int64_t T, H, F, E, K, Fs;
  Routing routing;
  double mask_frac;
  bool sampled;  // reference on a sample (big shapes) instead of everything
};

struct Host {
  std::vector<uint16_t> x, dy, wg, wu, wd, sg, su, sd;
  std::vector<int32_t> ids;
  std::vector<float> tw;
  std::vector<uint8_t> mask;
};

static void make_inputs(const Case& c, uint64_t seed, Host& h) {
  fill_bf16(h.x, c.T * c.H, 1.0f, seed + 1);
  fill_bf16(h.dy, c.T * c.H, 1.0f, seed + 11);
  fill_bf16(h.wg, c.E * c.H * c.F, 2.0f / std::sqrt(float(c.H)), seed + 2);
  fill_bf16(h.wu, c.E * c.H * c.F, 2.0f / std::sqrt(float(c.H)), seed + 3);
  fill_bf16(h.wd, c.E * c.F * c.H, 2.0f / std::sqrt(float(c.F)), seed + 4);
  if (c.Fs > 0) {
    fill_bf16(h.sg, c.H * c.Fs, 2.0f / std::sqrt(float(c.H)), seed + 5);
    fill_bf16(h.su, c.H * c.Fs, 2.0f / std::sqrt(float(c.H)), seed + 6);
    fill_bf16(h.sd, c.Fs * c.H, 2.0f / std::sqrt(float(c.Fs)), seed + 7);
  } else {
    h.sg.assign(8, 0x3f80);
    h.su.assign(8, 0x3f80);
    h.sd.assign(8, 0x3f80);
  }
  uint64_t s = seed * 31 + 17;
  h.ids.resize(c.T * c.K);
  h.tw.resize(c.T * c.K);
  h.mask.resize(c.T);
  std::vector<int> perm(c.E);
  const int subset[3] = {0, 5, 9};
  for (int64_t t = 0; t < c.T; ++t) {
    h.mask[t] = (unif(s) * 0.5 + 0.5) < c.mask_frac ? 0 : 1;
    for (int e = 0; e < c.E; ++e) perm[e] = e;
    for (int64_t k = 0; k < c.K; ++k) {
      const int j = static_cast<int>(k + splitmix(s) % (c.E - k));
      std::swap(perm[k], perm[j]);
    }
    if (c.routing == Routing::kSubset) {
      int a = static_cast<int>(splitmix(s) % 3);
      for (int64_t k = 0; k < c.K; ++k) perm[k] = subset[(a + k) % 3];
    }
    for (int64_t k = 0; k < c.K; ++k) {
      int id = perm[k];
      if (c.routing == Routing::kOneExpert) id = 5 % c.E;
      if (c.routing == Routing::kAllExperts) id = static_cast<int>((k + t) % c.E);
      if (c.routing == Routing::kBadIds && splitmix(s) % 7 == 0) {
        const int bad[4] = {-1, static_cast<int>(c.E), 1000, -123456};
        id = bad[splitmix(s) % 4];
      }
      h.ids[t * c.K + k] = id;
      h.tw[t * c.K + k] = 0.05f + 0.95f * (unif(s) * 0.5f + 0.5f);
    }
  }
}

template <typename T>
static T* dcopy(const std::vector<T>& v) {
  void* p;
  CK(cudaMalloc(&p, std::max<size_t>(16, v.size() * sizeof(T))));
  if (!v.empty()) CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}
static void* dalloc(size_t bytes) {
  void* p;
  CK(cudaMalloc(&p, std::max<size_t>(16, bytes)));
  return p;
}

struct Dev {
  void *x, *dy, *wg, *wu, *wd, *sg, *su, *sd, *y, *gp, *upp, *sgp, *sup, *fws, *bws;
  // Copies of the gate/up residuals: the backward overwrites them in place with
  // the gradient rows (as under XLA's aliasing), so each backward restores them.
  void *gp0, *upp0, *sgp0, *sup0;
  int32_t *ids, *eo, *rp, *pr;
  float* tw;
  uint8_t* mask;
  // backward outputs
  void *dx, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd;
  float* dtw;
  size_t fws_bytes, bws_bytes;
};

static Problem make_problem(const Case& c) {
  Problem pr;
  pr.tokens = c.T;
  pr.hidden = c.H;
  pr.ffn = c.F;
  pr.experts = c.E;
  pr.top_k = c.K;
  pr.shared_ffn = c.Fs;
  pr.dtype = DType::kBF16;
  return pr;
}

static void setup(const Problem& pr, const Host& h, Dev& d) {
  const int64_t R = pr.row_capacity(), T = pr.tokens, H = pr.hidden, F = pr.ffn, E = pr.experts;
  const int64_t Fs8 = std::max<int64_t>(pr.shared_ffn, 8);
  d.x = dcopy(h.x);
  d.dy = dcopy(h.dy);
  d.wg = dcopy(h.wg);
  d.wu = dcopy(h.wu);
  d.wd = dcopy(h.wd);
  d.sg = dcopy(h.sg);
  d.su = dcopy(h.su);
  d.sd = dcopy(h.sd);
  d.ids = dcopy(h.ids);
  d.tw = dcopy(h.tw);
  d.mask = dcopy(h.mask);
  d.y = dalloc(T * H * 2);
  d.gp = dalloc(R * F * 2);
  d.upp = dalloc(R * F * 2);
  d.sgp = dalloc(T * Fs8 * 2);
  d.sup = dalloc(T * Fs8 * 2);
  d.gp0 = dalloc(R * F * 2);
  d.upp0 = dalloc(R * F * 2);
  d.sgp0 = dalloc(T * Fs8 * 2);
  d.sup0 = dalloc(T * Fs8 * 2);
  d.eo = static_cast<int32_t*>(dalloc((E + 1) * 4));
  d.rp = static_cast<int32_t*>(dalloc(R * 4));
  d.pr = static_cast<int32_t*>(dalloc(pr.pairs() * 4));
  d.fws_bytes = mok::cuda::forward_workspace_bytes(pr);
  d.fws = dalloc(d.fws_bytes);
  // Sized for both backward modes (staged and megakernel), so one setup serves both.
  d.bws_bytes = std::max(mok::cuda::backward_workspace_bytes(pr, false), mok::cuda::backward_workspace_bytes(pr, true));
  d.bws = dalloc(d.bws_bytes);
  d.dx = dalloc(T * H * 2);
  d.dtw = static_cast<float*>(dalloc(pr.pairs() * 4));
  d.dwg = dalloc(E * H * F * 2);
  d.dwu = dalloc(E * H * F * 2);
  d.dwd = dalloc(E * F * H * 2);
  d.dsg = dalloc(H * Fs8 * 2);
  d.dsu = dalloc(H * Fs8 * 2);
  d.dsd = dalloc(H * Fs8 * 2);
}
static void teardown(Dev& d) {
  for (void* p : {d.x, d.dy, d.wg, d.wu, d.wd, d.sg, d.su, d.sd, d.y, d.gp, d.upp, d.sgp, d.sup, d.fws, d.bws,
                  d.gp0, d.upp0, d.sgp0, d.sup0,
                  (void*)d.ids, (void*)d.eo, (void*)d.rp, (void*)d.pr, (void*)d.tw, (void*)d.mask, d.dx,
                  (void*)d.dtw, d.dwg, d.dwu, d.dwd, d.dsg, d.dsu, d.dsd})
    CK(cudaFree(p));
}
static ForwardArgs fwd_args(const Dev& d) {
  ForwardArgs a;
  a.x = d.x;
  a.topk_ids = d.ids;
  a.topk_weights = d.tw;
  a.token_mask = d.mask;
  a.w_gate = d.wg;
  a.w_up = d.wu;
  a.w_down = d.wd;
  a.ws_gate = d.sg;
  a.ws_up = d.su;
  a.ws_down = d.sd;
  a.y = d.y;
  a.expert_offsets = d.eo;
  a.row_pair = d.rp;
  a.pair_row = d.pr;
  a.gate_pre = d.gp;
  a.up_pre = d.upp;
  a.shared_gate_pre = d.sgp;
  a.shared_up_pre = d.sup;
  return a;
}
static BackwardArgs bwd_args(const Dev& d) {
  BackwardArgs b;
  b.dy = d.dy;
  b.fwd = fwd_args(d);
  b.dx = d.dx;
  b.d_topk_weights = d.dtw;
  b.dw_gate = d.dwg;
  b.dw_up = d.dwu;
  b.dw_down = d.dwd;
  b.dws_gate = d.dsg;
  b.dws_up = d.dsu;
  b.dws_down = d.dsd;
  b.d_gate_rows = d.gp;  // in place over the residuals, as the FFI call aliases them
  b.d_up_rows = d.upp;
  b.d_shared_gate = d.sgp;
  b.d_shared_up = d.sup;
  return b;
}

// Saves (after a forward) or restores (before a backward) the gate/up residuals.
static void keep_residuals(const Problem& pr, const Dev& d, cudaStream_t st, bool save) {
  const size_t rf = static_cast<size_t>(pr.row_capacity()) * pr.ffn * 2;
  const size_t tf = static_cast<size_t>(pr.tokens) * pr.shared_ffn * 2;
  void* const live[4] = {d.gp, d.upp, d.sgp, d.sup};
  void* const kept[4] = {d.gp0, d.upp0, d.sgp0, d.sup0};
  const size_t bytes[4] = {rf, rf, tf, tf};
  for (int i = 0; i < 4; ++i)
    if (bytes[i]) CK(cudaMemcpyAsync(save ? kept[i] : live[i], save ? live[i] : kept[i], bytes[i],
                                     cudaMemcpyDeviceToDevice, st));
}

struct Res {  // forward residuals on the host
  std::vector<int32_t> eo, rp, pr;
  std::vector<uint16_t> gp, up, sgp, sup;
};
struct Grads {
  std::vector<uint16_t> dx, dwg, dwu, dwd, dsg, dsu, dsd;
  std::vector<float> dtw;
  bool operator==(const Grads& o) const {
    return dx == o.dx && dwg == o.dwg && dwu == o.dwu && dwd == o.dwd && dsg == o.dsg && dsu == o.dsu &&
           dsd == o.dsd && std::memcmp(dtw.data(), o.dtw.data(), dtw.size() * 4) == 0;
  }
};

template <typename T>
static void get(std::vector<T>& v, const void* p, size_t n) {
  v.resize(n);
  if (n) CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
}

static bool run_forward(const Problem& pr, const Dev& d, cudaStream_t st, Res* r) {
  const char* err = mok::cuda::forward(pr, fwd_args(d), d.fws, st);
  if (err) {
    std::printf("  forward returned error: %s\n", err);
    return false;
  }
  keep_residuals(pr, d, st, true);
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  if (r) {
    const int64_t R = pr.row_capacity();
    get(r->eo, d.eo, pr.experts + 1);
    get(r->rp, d.rp, R);
    get(r->pr, d.pr, pr.pairs());
    get(r->gp, d.gp, R * pr.ffn);
    get(r->up, d.upp, R * pr.ffn);
    get(r->sgp, d.sgp, pr.tokens * pr.shared_ffn);
    get(r->sup, d.sup, pr.tokens * pr.shared_ffn);
  }
  return true;
}

static void poison_bwd(const Problem& pr, const Dev& d) {
  const int64_t T = pr.tokens, H = pr.hidden, F = pr.ffn, E = pr.experts, Fs = pr.shared_ffn;
  CK(cudaMemset(d.dx, 0xFF, T * H * 2));
  CK(cudaMemset(d.dtw, 0xFF, pr.pairs() * 4));
  CK(cudaMemset(d.dwg, 0xFF, E * H * F * 2));
  CK(cudaMemset(d.dwu, 0xFF, E * H * F * 2));
  CK(cudaMemset(d.dwd, 0xFF, E * F * H * 2));
  if (Fs > 0) {
    CK(cudaMemset(d.dsg, 0xFF, H * Fs * 2));
    CK(cudaMemset(d.dsu, 0xFF, H * Fs * 2));
    CK(cudaMemset(d.dsd, 0xFF, H * Fs * 2));
  }
  CK(cudaMemset(d.bws, 0xFF, d.bws_bytes));
}

static bool run_backward(const Problem& pr, const Dev& d, cudaStream_t st, Grads& g, bool megakernel = false) {
  poison_bwd(pr, d);
  keep_residuals(pr, d, st, false);
  CK(cudaDeviceSynchronize());
  const char* err = mok::cuda::backward(pr, bwd_args(d), d.bws, st, nullptr, megakernel);
  if (err) {
    std::printf("  backward returned error: %s\n", err);
    return false;
  }
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  const int64_t T = pr.tokens, H = pr.hidden, F = pr.ffn, E = pr.experts, Fs = pr.shared_ffn;
  get(g.dx, d.dx, T * H);
  get(g.dtw, d.dtw, pr.pairs());
  get(g.dwg, d.dwg, E * H * F);
  get(g.dwu, d.dwu, E * H * F);
  get(g.dwd, d.dwd, E * F * H);
  get(g.dsg, d.dsg, H * Fs);
  get(g.dsu, d.dsu, H * Fs);
  get(g.dsd, d.dsd, H * Fs);
  return true;
}

// ------------------------------------------------------------------ fp64 reference
struct Ref {
  std::vector<double> dx, dtw, dwg, dwu, dwd, dsg, dsu, dsd;
};

static double sigm(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// One dense SwiGLU FFN backward over `rows` (token t, weight w, residual index ri):
// accumulates dW (if want_dw) and, for rows with want_tok[t], dx[t] and dscale.
struct RowRef {
  int64_t t, ri, p;
  double w;
};
static void ffn_ref(const Host& h, int64_t H, int64_t F, const std::vector<RowRef>& rows, const uint16_t* wg,
                    const uint16_t* wu, const uint16_t* wd, const uint16_t* gp, const uint16_t* up, bool want_dw,
                    const std::vector<char>& want_tok, double* dwg, double* dwu, double* dwd,
                    std::vector<double>* dx_rows /* per row, H */, double* dtw /* per pair */) {
  std::vector<double> WG(H * F), WU(H * F), WD(F * H), gd(F), dg(F), du(F), a(F), xt(H), dyt(H);
  for (int64_t i = 0; i < H * F; ++i) WG[i] = bf2d(wg[i]), WU[i] = bf2d(wu[i]), WD[i] = bf2d(wd[i]);
  for (size_t ri = 0; ri < rows.size(); ++ri) {
    const RowRef& r = rows[ri];
    const bool tok = want_tok[r.t] != 0;
    if (!want_dw && !tok) continue;
    for (int64_t j = 0; j < H; ++j) xt[j] = bf2d(h.x[r.t * H + j]), dyt[j] = bf2d(h.dy[r.t * H + j]);
    double dot = 0;
    for (int64_t f = 0; f < F; ++f) {
      double s = 0;
      const double* wrow = &WD[f * H];
      for (int64_t j = 0; j < H; ++j) s += dyt[j] * wrow[j];
      gd[f] = s;
      const double g = bf2d(gp[r.ri * F + f]), u = bf2d(up[r.ri * F + f]);
      const double sg = sigm(g), silu = g * sg;
      a[f] = silu * u;
      dot += s * a[f];
      const double da = r.w * s;
      du[f] = da * silu;
      dg[f] = da * u * sg * (1 + g * (1 - sg));
    }
    if (tok) {
      if (dtw) dtw[r.p] = dot;
      double* o = dx_rows[ri].data();
      for (int64_t j = 0; j < H; ++j) {
        double s = 0;
        const double* a1 = &WG[j * F];
        const double* a2 = &WU[j * F];
        for (int64_t f = 0; f < F; ++f) s += dg[f] * a1[f] + du[f] * a2[f];
        o[j] = s;
      }
    }
    if (want_dw) {
      for (int64_t j = 0; j < H; ++j) {
        const double xv = xt[j];
        double* g1 = dwg + j * F;
        double* g2 = dwu + j * F;
        for (int64_t f = 0; f < F; ++f) g1[f] += xv * dg[f], g2[f] += xv * du[f];
      }
      for (int64_t f = 0; f < F; ++f) {
        const double av = a[f] * r.w;
        double* o = dwd + f * H;
        for (int64_t j = 0; j < H; ++j) o[j] += av * dyt[j];
      }
    }
  }
}

static void reference(const Case& c, const Host& h, const Res& rs, const std::vector<char>& want_dw,
                      const std::vector<char>& want_tok, Ref& ref) {
  const int64_t T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, Fs = c.Fs;
  ref.dx.assign(T * H, 0.0);
  ref.dtw.assign(T * K, 0.0);
  ref.dwg.assign(E * H * F, 0.0);
  ref.dwu.assign(E * H * F, 0.0);
  ref.dwd.assign(E * F * H, 0.0);
  ref.dsg.assign(H * Fs, 0.0);
  ref.dsu.assign(H * Fs, 0.0);
  ref.dsd.assign(H * Fs, 0.0);
  std::vector<std::vector<RowRef>> rows(E + 1);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = rs.eo[e]; r < rs.eo[e + 1]; ++r)
      if (rs.rp[r] >= 0) {
        const int64_t p = rs.rp[r];
        rows[e].push_back({p / K, r, p, double(h.tw[p])});
      }
  if (Fs > 0)
    for (int64_t t = 0; t < T; ++t)
      if (h.mask[t]) rows[E].push_back({t, t, -1, 1.0});
  // Jobs: (group e, chunk of <= 256 rows), each with private dW accumulators.
  struct Job {
    int64_t e;
    size_t b, n;
    std::vector<double> g, u, dd;
  };
  std::vector<Job> jobs;
  for (int64_t e = 0; e <= E; ++e) {
    if (e == E && Fs == 0) break;
    for (size_t b = 0; b < rows[e].size(); b += 256) jobs.push_back({e, b, std::min<size_t>(256, rows[e].size() - b), {}, {}, {}});
  }
  std::vector<std::vector<std::vector<double>>> dxr(E + 1);
  for (int64_t e = 0; e <= E; ++e) {
    dxr[e].resize(rows[e].size());
    for (size_t i = 0; i < rows[e].size(); ++i)
      if (want_tok[rows[e][i].t]) dxr[e][i].assign(H, 0.0);
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (;;) {
      const size_t ji = next.fetch_add(1);
      if (ji >= jobs.size()) return;
      Job& jb = jobs[ji];
      const int64_t e = jb.e;
      const std::vector<RowRef> rr(rows[e].begin() + jb.b, rows[e].begin() + jb.b + jb.n);
      const bool wd = e == E || want_dw[e] != 0;
      const int64_t FF = e < E ? F : Fs;
      if (wd) {
        jb.g.assign(H * FF, 0.0);
        jb.u.assign(H * FF, 0.0);
        jb.dd.assign(H * FF, 0.0);
      }
      if (e < E)
        ffn_ref(h, H, F, rr, &h.wg[e * H * F], &h.wu[e * H * F], &h.wd[e * F * H], rs.gp.data(), rs.up.data(), wd,
                want_tok, jb.g.data(), jb.u.data(), jb.dd.data(), dxr[e].data() + jb.b, ref.dtw.data());
      else
        ffn_ref(h, H, Fs, rr, h.sg.data(), h.su.data(), h.sd.data(), rs.sgp.data(), rs.sup.data(), true, want_tok,
                jb.g.data(), jb.u.data(), jb.dd.data(), dxr[e].data() + jb.b, nullptr);
    }
  };
  std::vector<std::thread> th;
  for (unsigned i = 0; i < nthreads(); ++i) th.emplace_back(work);
  for (auto& t : th) t.join();
  for (Job& jb : jobs) {
    if (jb.g.empty()) continue;
    double *G, *U, *D;
    if (jb.e < E) G = &ref.dwg[jb.e * H * F], U = &ref.dwu[jb.e * H * F], D = &ref.dwd[jb.e * F * H];
    else G = ref.dsg.data(), U = ref.dsu.data(), D = ref.dsd.data();
    for (size_t i = 0; i < jb.g.size(); ++i) G[i] += jb.g[i], U[i] += jb.u[i], D[i] += jb.dd[i];
  }
  for (int64_t e = 0; e <= E; ++e)
    for (size_t i = 0; i < rows[e].size(); ++i) {
      const RowRef& r = rows[e][i];
      if (!want_tok[r.t]) continue;
      for (int64_t j = 0; j < H; ++j) ref.dx[r.t * H + j] += dxr[e][i][j];
    }
}

struct Err {
  double e2 = 0, r2 = 0, g2 = 0, gr = 0;
  bool nan = false;
  void add(double got, double want) {
    if (!std::isfinite(got)) nan = true;
    e2 += (got - want) * (got - want);
    r2 += want * want;
    g2 += got * got;
    gr += got * want;
  }
  double rel() const { return nan ? INFINITY : (r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2)); }
  double cosv() const { return nan ? 0.0 : (r2 > 0 && g2 > 0 ? gr / std::sqrt(r2 * g2) : (r2 == 0 && g2 == 0 ? 1.0 : 0.0)); }
  bool ok() const { return !nan && rel() <= 1e-2 && (r2 == 0 ? e2 == 0 : cosv() >= 0.9999); }
};

// --megakernel: the backward megakernel against the staged kernels.
static bool g_megakernel = false;

static bool check_case(const Case& c, uint64_t seed, cudaStream_t st) {
  const Problem pr = make_problem(c);
  Host h;
  make_inputs(c, seed, h);
  Dev d;
  setup(pr, h, d);
  Res rs;
  Grads g1, g2;
  bool ok = run_forward(pr, d, st, &rs) && run_backward(pr, d, st, g1) && run_backward(pr, d, st, g2);
  // The megakernel computes every tile with the staged kernels' instructions
  // and the same reduction order, so its gradients must be theirs bitwise.
  bool mega_same = true;
  if (ok && g_megakernel) {
    Grads g3;
    ok = run_backward(pr, d, st, g3, true);
    mega_same = ok && g3 == g1;
  }
  if (!ok) {
    teardown(d);
    return false;
  }
  const bool det = g1 == g2;
  const int64_t T = c.T, H = c.H, F = c.F, E = c.E, K = c.K, Fs = c.Fs;
  std::vector<char> want_dw(E, 1), want_tok(T, 1);
  if (c.sampled) {
    std::fill(want_dw.begin(), want_dw.end(), 0);
    std::fill(want_tok.begin(), want_tok.end(), 0);
    want_dw[3 % E] = 1;
    for (int64_t t = 0; t < T; t += std::max<int64_t>(1, T / 48)) want_tok[t] = 1;
  }
  Ref ref;
  reference(c, h, rs, want_dw, want_tok, ref);

  Err edx, edtw, eg, eu, ed, esg, esu, esd;
  bool zeros_ok = true;
  for (int64_t t = 0; t < T; ++t) {
    if (!want_tok[t]) continue;
    for (int64_t j = 0; j < H; ++j) edx.add(bf2d(g1.dx[t * H + j]), ref.dx[t * H + j]);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      edtw.add(g1.dtw[p], ref.dtw[p]);
      if (rs.pr[p] < 0 && g1.dtw[p] != 0.0f) zeros_ok = false;
    }
    if (!h.mask[t])
      for (int64_t j = 0; j < H; ++j)
        if (g1.dx[t * H + j] != 0) zeros_ok = false;
  }
  int empty = 0;
  for (int64_t e = 0; e < E; ++e) {
    const bool is_empty = rs.eo[e] == rs.eo[e + 1];
    if (is_empty) {
      ++empty;
      for (int64_t i = 0; i < H * F; ++i)
        if (g1.dwg[e * H * F + i] != 0 || g1.dwu[e * H * F + i] != 0 || g1.dwd[e * H * F + i] != 0) {
          zeros_ok = false;
          break;
        }
    }
    if (!want_dw[e]) continue;
    for (int64_t i = 0; i < H * F; ++i) {
      eg.add(bf2d(g1.dwg[e * H * F + i]), ref.dwg[e * H * F + i]);
      eu.add(bf2d(g1.dwu[e * H * F + i]), ref.dwu[e * H * F + i]);
      ed.add(bf2d(g1.dwd[e * H * F + i]), ref.dwd[e * H * F + i]);
    }
  }
  for (int64_t i = 0; i < H * Fs; ++i) {
    esg.add(bf2d(g1.dsg[i]), ref.dsg[i]);
    esu.add(bf2d(g1.dsu[i]), ref.dsu[i]);
    esd.add(bf2d(g1.dsd[i]), ref.dsd[i]);
  }
  const bool num_ok =
      edx.ok() && edtw.ok() && eg.ok() && eu.ok() && ed.ok() && (Fs == 0 || (esg.ok() && esu.ok() && esd.ok()));
  ok = det && mega_same && zeros_ok && num_ok;
  double worst_cos = std::min({edx.cosv(), edtw.cosv(), eg.cosv(), eu.cosv(), ed.cosv()});
  if (Fs > 0) worst_cos = std::min({worst_cos, esg.cosv(), esu.cosv(), esd.cosv()});
  std::printf(
      "  %-12s T=%-5lld H=%-4lld F=%-4lld E=%-3lld K=%-2lld Fs=%-4lld empty=%-2d rows in %-9s | relL2 dx %.1e dtw %.1e dWg %.1e dWu %.1e "
      "dWd %.1e dWsg %.1e dWsu %.1e dWsd %.1e | min cos %.7f | zeros %s determ %s megakernel %s => %s\n",
      c.name, (long long)T, (long long)H, (long long)F, (long long)E, (long long)K, (long long)Fs, empty,
      mok::cuda::backward_rows_in_outputs(pr) ? "outputs" : "workspace", edx.rel(),
      edtw.rel(), eg.rel(), eu.rel(), ed.rel(), Fs ? esg.rel() : 0.0, Fs ? esu.rel() : 0.0, Fs ? esd.rel() : 0.0,
      worst_cos, zeros_ok ? "ok" : "BAD", det ? "ok" : "BAD", g_megakernel ? (mega_same ? "same" : "DIFFERS") : "-",
      ok ? "PASS" : "FAIL");
  std::fflush(stdout);
  teardown(d);
  return ok;
}

// --no-check: the timing runs skip their sampled check (the correctness runs cover it).
static bool g_no_check = false;
// --shape: the timing shape (T, H, F, E, K; default benchmark shape 1).
static long long g_shape[5] = {32768, 2048, 768, 128, 8};

// backward_cuda.cu's row placement without the megakernel: the routed rows
// live in the weight-gradient outputs (and dW_gate, dW_up run after the
// combine) when they are small beside the weights.
static bool rows_in_outputs(const Case& c) {
  const int64_t R = make_problem(c).row_capacity();
  return R * (c.H + c.F) <= c.E * c.H * c.F;
}

static int run_timing(int iters, cudaStream_t st, bool with_shared) {
  Case c{"bench", g_shape[0], g_shape[1], g_shape[2], g_shape[3], g_shape[4], with_shared ? 2048 : 0,
         Routing::kUniform, 0.0, true};
  const Problem pr = make_problem(c);
  std::printf("%s: ", g_megakernel ? "megakernel" : "staged");
  std::printf("timing shape T=%lld H=%lld F=%lld E=%lld K=%lld Fs=%lld  R=%lld  bwd workspace=%.1f MiB, rows in %s\n",
              (long long)c.T, (long long)c.H, (long long)c.F, (long long)c.E, (long long)c.K, (long long)c.Fs,
              (long long)pr.row_capacity(), mok::cuda::backward_workspace_bytes(pr, g_megakernel) / 1048576.0,
              mok::cuda::backward_rows_in_outputs(pr, g_megakernel) ? "outputs" : "workspace");
  Host h;
  make_inputs(c, 1234, h);
  Dev d;
  setup(pr, h, d);
  if (!run_forward(pr, d, st, nullptr)) return 1;
  const BackwardArgs args = bwd_args(d);
  mok::cuda::BackwardStageEvents se;
  for (auto& e : se.ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i) {
    keep_residuals(pr, d, st, false);
    const char* err = mok::cuda::backward(pr, args, d.bws, st, nullptr, g_megakernel);
    if (err) {
      std::printf("backward error: %s\n", err);
      return 1;
    }
  }
  CK(cudaStreamSynchronize(st));
  CK(cudaGetLastError());
  std::vector<float> tot, stage[5];
  for (int i = 0; i < iters; ++i) {
    keep_residuals(pr, d, st, false);  // before ev[0]: not timed
    const char* err = mok::cuda::backward(pr, args, d.bws, st, &se, g_megakernel);
    if (err) {
      std::printf("backward error: %s\n", err);
      return 1;
    }
    CK(cudaEventSynchronize(se.ev[5]));
    float ms;
    CK(cudaEventElapsedTime(&ms, se.ev[0], se.ev[5]));
    tot.push_back(ms);
    for (int s = 0; s < 5; ++s) {
      CK(cudaEventElapsedTime(&ms, se.ev[s], se.ev[s + 1]));
      stage[s].push_back(ms);
    }
  }
  CK(cudaGetLastError());
  auto med = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double tkhf = double(c.T) * c.K * c.H * c.F, shf = double(c.T) * c.H * c.Fs;
  const double t_ms = med(tot);
  const double s1 = med(stage[1]), s2 = med(stage[2]), s3 = med(stage[3]);
  std::printf("  backward median %.3f ms (min %.3f, max %.3f, n=%d)  useful %.1f TFLOP/s (2*6*T*K*H*F%s)\n", t_ms,
              *std::min_element(tot.begin(), tot.end()), *std::max_element(tot.begin(), tot.end()), iters,
              12.0 * tkhf / (t_ms * 1e-3) / 1e12, with_shared ? "; shared excluded" : "");
  if (with_shared) std::printf("  incl shared FLOPs: %.1f TFLOP/s\n", 12.0 * (tkhf + shf) / (t_ms * 1e-3) / 1e12);
  if (g_megakernel)  // the megakernel runs between ev[2] and ev[3]
    std::printf("  prep+gather %.3f ms | megakernel (dgrad-down+swiglu, wgrad x3, dgrad gate+up) %.3f ms (%.1f TF) | "
                "combine %.3f ms\n",
                med(stage[0]), s1 + s2 + s3, 12.0 * (tkhf + shf) / ((s1 + s2 + s3) * 1e-3) / 1e12, med(stage[4]));
  else if (rows_in_outputs(c))  // backward_cuda.cu's layout: dW_gate, dW_up run after the combine
    std::printf("  prep+gather %.3f ms | dgrad-down+swiglu %.3f ms (%.1f TF) | wgrad dW_down %.3f ms (%.1f TF) | "
                "dgrad gate+up %.3f ms (%.1f TF) | combine + wgrad dW_gate, dW_up %.3f ms\n",
                med(stage[0]), s1, 2.0 * (tkhf + shf) / (s1 * 1e-3) / 1e12, s2, 2.0 * tkhf / (s2 * 1e-3) / 1e12, s3,
                4.0 * (tkhf + shf) / (s3 * 1e-3) / 1e12, med(stage[4]));
  else
    std::printf("  prep+gather %.3f ms | dgrad-down+swiglu %.3f ms (%.1f TF) | wgrad x3 %.3f ms (%.1f TF) | "
                "dgrad gate+up %.3f ms (%.1f TF) | combine %.3f ms\n",
                med(stage[0]), s1, 2.0 * (tkhf + shf) / (s1 * 1e-3) / 1e12, s2, 6.0 * (tkhf + shf) / (s2 * 1e-3) / 1e12,
                s3, 4.0 * (tkhf + shf) / (s3 * 1e-3) / 1e12, med(stage[4]));
  for (auto& e : se.ev) CK(cudaEventDestroy(e));
  teardown(d);
  // sampled correctness + determinism at this shape (fresh inputs)
  if (g_no_check) return 0;
  return check_case(c, 99, st) ? 0 : 1;
}

int main(int argc, char** argv) {
  bool corr = false, small = false, timing = false, shared_timing = false;
  int iters = 20;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--correctness") corr = true;
    else if (a == "--small") small = corr = true;
    else if (a == "--timing") timing = true;
    else if (a == "--timing-shared") shared_timing = true;
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--case" && i + 1 < argc) { only = argv[++i]; corr = true; small = true; }
    else if (a == "--no-check") g_no_check = true;
    else if (a == "--megakernel") g_megakernel = true;
    else if (a == "--shape" && i + 1 < argc) {
      long long* v = g_shape;
      if (std::sscanf(argv[++i], "%lld,%lld,%lld,%lld,%lld", &v[0], &v[1], &v[2], &v[3], &v[4]) != 5) {
        std::printf("--shape wants T,H,F,E,K\n");
        return 2;
      }
    }
    else {
      std::printf("unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!corr && !timing && !shared_timing) corr = timing = true;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, cc %d.%d\n", prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int fails = 0;
  if (corr) {
    std::vector<Case> cases = {
        {"base", 300, 256, 192, 8, 2, 0, Routing::kUniform, 0.0, false},
        {"shared", 300, 320, 192, 8, 2, 200, Routing::kUniform, 0.0, false},
        {"odd_dims", 257, 328, 136, 6, 3, 72, Routing::kUniform, 0.1, false},
        {"one_expert", 513, 256, 128, 8, 1, 0, Routing::kOneExpert, 0.0, false},
        {"empty_exp", 400, 256, 128, 16, 2, 0, Routing::kSubset, 0.0, false},
        {"k_eq_e", 200, 128, 64, 4, 4, 64, Routing::kAllExperts, 0.0, false},
        {"k1", 333, 192, 96, 5, 1, 0, Routing::kUniform, 0.0, false},
        {"masked", 300, 256, 192, 8, 2, 128, Routing::kUniform, 0.3, false},
        {"bad_ids", 300, 256, 192, 8, 2, 64, Routing::kBadIds, 0.2, false},
        {"tiny", 1, 64, 64, 3, 2, 64, Routing::kUniform, 0.0, false},
        {"all_masked", 64, 128, 64, 4, 2, 64, Routing::kUniform, 1.01, false},
        // rows small beside the weights: the row buffers live in the gradient outputs
        {"dw_rows", 150, 512, 768, 4, 2, 0, Routing::kUniform, 0.1, false},          // H <= F: xs regathered
        {"dw_rows_hf", 150, 768, 512, 4, 2, 96, Routing::kSubset, 0.0, false},      // H > F: xs in workspace
    };
    if (!small) {
      cases.push_back({"bigger", 1500, 512, 384, 16, 4, 256, Routing::kUniform, 0.05, false});
      cases.push_back({"bigger_skew", 1000, 512, 384, 32, 4, 0, Routing::kSubset, 0.0, false});
      cases.push_back({"wide", 700, 1024, 1280, 8, 2, 0, Routing::kUniform, 0.0, false});
    }
    if (!only.empty()) {
      std::vector<Case> keep;
      for (const Case& c : cases)
        if (only == c.name) keep.push_back(c);
      cases.swap(keep);
    }
    std::printf("correctness (%zu cases):\n", cases.size());
    uint64_t seed = 42;
    for (const Case& c : cases) fails += check_case(c, seed++, st) ? 0 : 1;
    std::printf("correctness: %d/%zu cases passed\n", int(cases.size()) - fails, cases.size());
  }
  if (timing) fails += run_timing(iters, st, false);
  if (shared_timing) fails += run_timing(iters, st, true);
  CK(cudaStreamDestroy(st));
  std::printf("RESULT: %s\n", fails == 0 ? "ALL PASS" : "FAILURES");
  return fails == 0 ? 0 : 1;
}
