// Orchestration of the CUDA backward (see backward_cuda.h).
//
// Workspace layout (each region 256-byte aligned, in this order):
//   tile_expert  int32[R / 128]
//   part         fp32[R * ceil(F / 256)]   partial <gd, a> per row and 256-column tile
//   xs           bf16[R, H]   gathered x rows        (workspace placement only, see below)
//   dys          bf16[R, H]   gathered dy rows; reused for dxs after the wgrads   (")
//   aw           bf16[R, F]                                                       (")
//   saw bf16[T, Fs], sdx bf16[T, H]   (Fs > 0 only)
// (R = row_capacity = round_up(T*K + E*127, 128)). dg and du (and the shared
// expert's) go to BackwardArgs::d_gate_rows etc., which the FFI call aliases
// with the spent gate_pre/up_pre residuals: the SwiGLU-backward epilogue reads
// each residual element once, in the warp that then overwrites it.
//
// Row placement. When the routed rows are small beside the weights
// (R (H + F) <= E H F: Mixtral-like shapes, one rank's slice at high EP), the
// row buffers live in the weight-gradient outputs before those are written,
// so the step's peak holds little beyond the outputs and the residuals:
//   dys, aw -> dW_gate's buffer; dW_down = aw^T dys first; then dxs -> dW_gate's
//   buffer; combine; then, when H <= F, xs is gathered into dW_up's buffer for
//   dW_gate = xs^T dg, and gathered again into the spent dg rows for
//   dW_up = xs^T du (one extra gather of R H elements instead of R H of
//   workspace); when H > F, xs stays in the workspace and the two wgrads share
//   one launch. Otherwise (rows larger than the weights) everything above sits
//   in the workspace and the three wgrads share one launch.
#include "backward_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <initializer_list>

#include "combine_row.cuh"
#include "cuda_problem.h"
#include "forward_cuda.h"
#include "gemm_wgmma.cuh"
#include "megakernel_bwd.cuh"

namespace mok::cuda {
namespace {

struct Layout {
  size_t tile_expert, part, xs, dys, aw, saw, sdx, counters, total;
  bool megakernel;       // the GEMMs run as one persistent kernel (megakernel_bwd.cuh)
  bool rows_in_outputs;  // dys, aw and dxs live in dW_gate's buffer (see the top of the file)
  bool xs_in_workspace;  // else xs is gathered into dW_up's buffer, then into the spent dg rows
};

int64_t f_tiles(const Problem& p) { return (p.ffn + 255) / 256; }

Layout make_layout(const Problem& p, bool megakernel) {
  Layout L{};
  WorkspaceCarver ws;
  auto take = [&](size_t bytes) { return ws.take(bytes); };
  const size_t R = static_cast<size_t>(p.row_capacity());
  const size_t H = static_cast<size_t>(p.hidden), F = static_cast<size_t>(p.ffn);
  const size_t T = static_cast<size_t>(p.tokens), Fs = static_cast<size_t>(p.shared_ffn);
  L.tile_expert = take(R / static_cast<size_t>(p.tile_rows) * sizeof(int32_t));
  L.part = take(R * static_cast<size_t>(f_tiles(p)) * sizeof(float));
  const size_t E = static_cast<size_t>(p.experts);
  // The megakernel runs every GEMM at once, so no row buffer can wait in a
  // weight gradient's output for its turn: the rows stay in the workspace.
  L.megakernel = megakernel;
  L.rows_in_outputs = !L.megakernel && R * (H + F) <= E * H * F;
  L.xs_in_workspace = !L.rows_in_outputs || H > F;
  if (L.xs_in_workspace) L.xs = take(R * H * 2);
  if (!L.rows_in_outputs) {
    L.dys = take(R * H * 2);
    L.aw = take(R * F * 2);
  }
  if (Fs > 0) {
    L.saw = take(T * Fs * 2);
    L.sdx = take(T * H * 2);
  }
  if (L.megakernel) L.counters = take(backward_megakernel_counter_bytes(p));
  L.total = ws.total();
  return L;
}

// tile_expert[t] = the expert whose padded segment holds rows [128 t, 128 t + 128),
// -1 past expert_offsets[E].
__global__ void tile_expert_kernel(const int32_t* __restrict__ offsets, int E, int64_t tiles,
                                   int32_t* __restrict__ tile_expert) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= tiles) return;
  const int64_t row = t * 128;
  if (row >= offsets[E]) {
    tile_expert[t] = -1;
    return;
  }
  // last e with offsets[e] <= row (empty experts have offsets[e] == offsets[e+1])
  int lo = 0, hi = E;  // offsets[lo] <= row < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= row) lo = mid;
    else hi = mid;
  }
  tile_expert[t] = lo;
}

constexpr int kCombThreads = 256;
constexpr int kMaxK = 64;

// dx[t] = bf16(sum_{k in order} dxs[pair_row[t,k]] + sdx[t]) (fp32), 0 for masked
// tokens; d_topk_weights[t,k] = sum_{j in order} part[row * nft + j], 0 if unrouted.
__global__ void __launch_bounds__(kCombThreads) combine_bwd(int64_t T, int64_t vec_per_row, int K, int nft,
                                                            const uint8_t* __restrict__ mask,
                                                            const int32_t* __restrict__ pair_row,
                                                            const uint4* __restrict__ dxs,
                                                            const uint4* __restrict__ sdx,
                                                            const float* __restrict__ part, uint4* __restrict__ dx,
                                                            float* __restrict__ dtw) {
  __shared__ int32_t rows[kMaxK];
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    __syncthreads();
    const bool live = mask[t] != 0;
    if (threadIdx.x < K) {
      const int32_t r = live ? pair_row[t * K + threadIdx.x] : -1;
      rows[threadIdx.x] = r;
      float d = 0.0f;
      if (r >= 0)
        for (int j = 0; j < nft; ++j) d += part[int64_t(r) * nft + j];
      dtw[t * K + threadIdx.x] = d;
    }
    __syncthreads();
    uint4* drow = dx + t * vec_per_row;
    if (!live) {
      for (int64_t c = threadIdx.x; c < vec_per_row; c += kCombThreads) drow[c] = make_uint4(0, 0, 0, 0);
      continue;
    }
    for (int64_t c = threadIdx.x; c < vec_per_row; c += kCombThreads) {
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = 0.f;
      for (int k = 0; k < K; ++k) {
        const int32_t r = rows[k];
        if (r >= 0) combine_acc8(a, __ldg(dxs + int64_t(r) * vec_per_row + c), 1.0f);  // fma(1, v, a) == a + v
      }
      if (sdx) combine_acc8(a, __ldg(sdx + t * vec_per_row + c), 1.0f);
      drow[c] = combine_pack8(a);
    }
  }
}

}  // namespace

size_t backward_workspace_bytes(const Problem& problem, bool megakernel) {
  if (unsupported_problem(problem) != nullptr) return 0;
  return make_layout(problem, megakernel).total;
}

bool backward_rows_in_outputs(const Problem& problem, bool megakernel) {
  return make_layout(problem, megakernel).rows_in_outputs;
}

namespace detail {

const char* launch_shared_backward(const Problem& p, const SharedBackwardArgs& a, int sms, cudaStream_t stream) {
  const int64_t T = p.tokens, H = p.hidden, Fs = p.shared_ffn;
  if (Fs <= 0) return nullptr;
  if (T <= 0) {  // no tokens: exact zeros
    const size_t bytes = static_cast<size_t>(H) * Fs * 2;
    if (cudaMemsetAsync(a.dws_gate, 0, bytes, stream) != cudaSuccess ||
        cudaMemsetAsync(a.dws_up, 0, bytes, stream) != cudaSuccess ||
        cudaMemsetAsync(a.dws_down, 0, bytes, stream) != cudaSuccess)
      return "mok cuda backward: memset failed";
    return nullptr;
  }
  DgradArgs g;
  g.a0 = a.dy;
  g.m_rows = T;
  g.k = H;
  g.b0 = a.ws_down;  // [Fs, H]
  g.groups = 1;
  g.n = Fs;
  g.gate_pre = a.gate_pre;
  g.up_pre = a.up_pre;
  g.row_mask = a.token_mask;
  g.out0 = a.d_gate;
  g.out1 = a.d_up;
  g.out2 = a.saw;
  if (const char* e = launch_dgrad_swiglu_bwd(g, sms, stream)) return e;
  WgradArgs w;
  w.jobs = 3;
  w.job[0] = WgradJob{a.x, H, a.d_gate, Fs, a.dws_gate};
  w.job[1] = WgradJob{a.x, H, a.d_up, Fs, a.dws_up};
  w.job[2] = WgradJob{a.saw, Fs, a.dy, H, a.dws_down};
  w.rows = T;
  w.groups = 1;
  if (const char* e = launch_wgrad(w, sms, stream)) return e;
  DgradArgs d;
  d.a0 = a.d_gate;
  d.a1 = a.d_up;
  d.m_rows = T;
  d.k = Fs;
  d.b0 = a.ws_gate;  // [H, Fs]
  d.b1 = a.ws_up;
  d.groups = 1;
  d.n = H;
  d.out0 = a.sdx;
  return launch_dgrad_sum2(d, sms, stream);
}

const char* launch_combine_bwd(const Problem& p, const uint8_t* token_mask, const int32_t* pair_row, const void* dxs,
                               const void* sdx, const float* part, void* dx, float* d_topk_weights, int sms,
                               cudaStream_t stream) {
  const int64_t T = p.tokens;
  if (T <= 0) return nullptr;
  if (p.top_k > kMaxK) return "mok cuda backward: top_k > 64 unsupported";
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(T, int64_t(sms) * 16)));
  combine_bwd<<<grid, kCombThreads, 0, stream>>>(T, p.hidden / 8, static_cast<int>(p.top_k), backward_parts(p),
                                                 token_mask, pair_row, static_cast<const uint4*>(dxs),
                                                 static_cast<const uint4*>(sdx), part, static_cast<uint4*>(dx),
                                                 d_topk_weights);
  return cudaGetLastError() == cudaSuccess ? nullptr : "mok cuda backward: combine launch failed";
}

}  // namespace detail

const char* backward(const Problem& p, const BackwardArgs& a, void* workspace, cudaStream_t stream,
                     const BackwardStageEvents* ev, bool megakernel) {
  if (const char* e = unsupported_problem(p)) return e;
  if (workspace == nullptr || !aligned16(workspace)) return "mok cuda backward: workspace missing or misaligned";
  const ForwardArgs& f = a.fwd;
  if (!aligned16(a.dy) || !aligned16(f.x) || !aligned16(f.w_gate) || !aligned16(f.w_up) || !aligned16(f.w_down) ||
      !aligned16(f.gate_pre) || !aligned16(f.up_pre) || !aligned16(a.dx) || !aligned16(a.dw_gate) ||
      !aligned16(a.dw_up) || !aligned16(a.dw_down))
    return "mok cuda backward: tensors must be 16-byte aligned";
  if (a.d_gate_rows == nullptr || a.d_up_rows == nullptr || !aligned16(a.d_gate_rows) || !aligned16(a.d_up_rows))
    return "mok cuda backward: gate/up gradient rows missing or misaligned";
  const bool has_shared = p.shared_ffn > 0;
  if (has_shared && (!aligned16(f.ws_gate) || !aligned16(f.ws_up) || !aligned16(f.ws_down) ||
                     !aligned16(f.shared_gate_pre) || !aligned16(f.shared_up_pre) || !aligned16(a.dws_gate) ||
                     !aligned16(a.dws_up) || !aligned16(a.dws_down) || a.d_shared_gate == nullptr ||
                     a.d_shared_up == nullptr || !aligned16(a.d_shared_gate) || !aligned16(a.d_shared_up)))
    return "mok cuda backward: shared-expert tensors must be 16-byte aligned";

  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    return "mok cuda backward: cannot query device";

  const Layout L = make_layout(p, megakernel);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  int32_t* tile_expert = reinterpret_cast<int32_t*>(ws + L.tile_expert);
  float* part = reinterpret_cast<float*>(ws + L.part);
  const int64_t R = p.row_capacity(), T = p.tokens, H = p.hidden, F = p.ffn, E = p.experts;
  void* dg = a.d_gate_rows;  // may alias f.gate_pre (read before overwritten)
  void* du = a.d_up_rows;    // may alias f.up_pre
  uint8_t* dw_gate_buf = static_cast<uint8_t*>(a.dw_gate);
  void* dys = L.rows_in_outputs ? dw_gate_buf : ws + L.dys;
  void* aw = L.rows_in_outputs ? dw_gate_buf + static_cast<size_t>(R) * H * 2 : ws + L.aw;
  void* xs = L.xs_in_workspace ? ws + L.xs : nullptr;  // else gathered late (step 6)
  const bool shared_rows = has_shared && T > 0;

  // The token rows of src (x or dy) gathered into expert-major padded rows (padding rows zero).
  auto gather_rows = [&](const void* src, void* dst) {
    return detail::launch_dispatch(p, src, f.row_pair, f.pair_row, f.expert_offsets, dst, sms, stream);
  };
  auto mark = [&](int i) -> bool { return ev == nullptr || cudaEventRecord(ev->ev[i], stream) == cudaSuccess; };
  if (!mark(0)) return "mok cuda backward: event record failed";

  // 1. prep: tile -> expert, gathers (padding rows below expert_offsets[E] zeroed)
  {
    const int64_t tiles = R / 128;
    tile_expert_kernel<<<static_cast<unsigned>((tiles + 255) / 256), 256, 0, stream>>>(
        f.expert_offsets, static_cast<int>(E), tiles, tile_expert);
    if (cudaGetLastError() != cudaSuccess) return "mok cuda backward: tile_expert launch failed";
    if (const char* e = xs != nullptr ? gather_rows(f.x, xs) : nullptr) return e;
    if (const char* e = gather_rows(a.dy, dys)) return e;
  }
  if (!mark(1)) return "mok cuda backward: event record failed";

  // 2. dgrad-down + SwiGLU backward (a phase of the megakernel when it runs)
  if (!L.megakernel) {
    DgradArgs g;
    g.a0 = dys;
    g.m_rows = R;
    g.k = H;
    g.b0 = f.w_down;  // [E, F, H] = [groups, n, k]
    g.groups = E;
    g.n = F;
    g.tile_group = tile_expert;
    g.gate_pre = f.gate_pre;
    g.up_pre = f.up_pre;
    g.row_pair = f.row_pair;
    g.pair_weight = f.topk_weights;
    g.out0 = dg;
    g.out1 = du;
    g.out2 = aw;
    g.part = part;
    if (const char* e = launch_dgrad_swiglu_bwd(g, sms, stream)) return e;
  }
  if (has_shared) {  // the shared expert's whole backward (its dx rows into sdx)
    detail::SharedBackwardArgs sb{a.dy,          f.x,          f.token_mask,   f.ws_gate,      f.ws_up,
                                  f.ws_down,     f.shared_gate_pre, f.shared_up_pre, a.d_shared_gate,
                                  a.d_shared_up, ws + L.saw,   ws + L.sdx,     a.dws_gate,     a.dws_up,
                                  a.dws_down};
    if (const char* e = detail::launch_shared_backward(p, sb, sms, stream)) return e;
  }
  if (!mark(2)) return "mok cuda backward: event record failed";

  auto expert_wgrad = [&](std::initializer_list<WgradJob> jobs) -> const char* {
    WgradArgs w;
    for (const WgradJob& j : jobs) w.job[w.jobs++] = j;
    w.rows = R;
    w.groups = E;
    w.offsets = f.expert_offsets;
    return launch_wgrad(w, sms, stream);
  };
  void* dxs = dys;  // dxs goes over the spent dy rows (dW_gate's buffer when the rows live there)
  if (L.megakernel) {
    // 2-4. the dgrad-down, the weight gradients and dxs in one persistent launch
    BackwardMegakernelArgs m;
    m.expert_offsets = f.expert_offsets;
    m.tile_expert = tile_expert;
    m.row_pair = f.row_pair;
    m.topk_weights = f.topk_weights;
    m.xs = xs;
    m.dys = dys;
    m.w_gate = f.w_gate;
    m.w_up = f.w_up;
    m.w_down = f.w_down;
    m.gate_pre = f.gate_pre;
    m.up_pre = f.up_pre;
    m.dg = dg;
    m.du = du;
    m.aw = aw;
    m.part = part;
    m.dw_gate = a.dw_gate;
    m.dw_up = a.dw_up;
    m.dw_down = a.dw_down;
    m.counters = reinterpret_cast<int32_t*>(ws + L.counters);
    if (const char* e = launch_backward_megakernel(p, m, sms, stream)) return e;
    if (!mark(3) || !mark(4)) return "mok cuda backward: event record failed";
  } else {
    // 3. weight gradients (K = each expert's padded rows; padding rows are zero):
    // all three here, or only dW_down when the rows live in dW_gate's buffer.
    if (const char* e = L.rows_in_outputs
                            ? expert_wgrad({WgradJob{aw, F, dys, H, a.dw_down}})
                            : expert_wgrad({WgradJob{xs, H, dg, F, a.dw_gate}, WgradJob{xs, H, du, F, a.dw_up},
                                            WgradJob{aw, F, dys, H, a.dw_down}}))
      return e;
    if (!mark(3)) return "mok cuda backward: event record failed";

    // 4. dxs = dg @ w_gate^T + du @ w_up^T  (into the dys buffer, no longer needed)
    DgradArgs g;
    g.a0 = dg;
    g.a1 = du;
    g.m_rows = R;
    g.k = F;
    g.b0 = f.w_gate;  // [E, H, F] = [groups, n, k]
    g.b1 = f.w_up;
    g.groups = E;
    g.n = H;
    g.tile_group = tile_expert;
    g.out0 = dxs;
    if (const char* e = launch_dgrad_sum2(g, sms, stream)) return e;
    if (!mark(4)) return "mok cuda backward: event record failed";
  }

  // 5. combine dx and d_topk_weights
  if (const char* e = detail::launch_combine_bwd(p, f.token_mask, f.pair_row, dxs, shared_rows ? ws + L.sdx : nullptr,
                                                 part, a.dx, a.d_topk_weights, sms, stream))
    return e;

  // 6. the gate/up weight gradients when the rows lived in dW_gate's buffer
  // (dxs is spent now)
  if (L.rows_in_outputs) {
    if (L.xs_in_workspace) {
      if (const char* e = expert_wgrad({WgradJob{xs, H, dg, F, a.dw_gate}, WgradJob{xs, H, du, F, a.dw_up}})) return e;
    } else {
      // xs into dW_up's buffer for dW_gate, then into the spent dg rows (H <= F) for dW_up
      if (const char* e = gather_rows(f.x, a.dw_up)) return e;
      if (const char* e = expert_wgrad({WgradJob{a.dw_up, H, dg, F, a.dw_gate}})) return e;
      if (const char* e = gather_rows(f.x, dg)) return e;
      if (const char* e = expert_wgrad({WgradJob{dg, H, du, F, a.dw_up}})) return e;
    }
  }
  if (!mark(5)) return "mok cuda backward: event record failed";
  return nullptr;
}

}  // namespace mok::cuda
