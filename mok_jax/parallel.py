"""Expert parallelism (EP): the MoE layer with its experts sharded over a mesh axis.

Two entry points, both reached through `mok_jax.moe_layer`:

* ``mesh=`` (global arrays): `jax.custom_vjp` outside, one `jax.shard_map` in
  the forward and one in the backward (``../shared/reference/jax_ffi.md``
  §4.1). Expert weights are split along E over ``expert_axis``, tokens along
  T over ``token_axes``, router and shared experts replicated.
* ``axis_name=`` (inside the caller's own `shard_map`): the same per-rank
  forward/backward under a `jax.custom_vjp`, with every input first cast to
  vary over the union of the inputs' varying axes (so replicated weights get
  psum'd cotangents by the transpose of that cast, as in `experts`).

Per rank, ``dispatch="collective"`` runs in rounds (MoK's macrobatches): in
round j every rank sends to every destination rank the next ``C`` of its
(token, k) pairs routed there, as one `all_to_all` of a fixed ``[EP*C, H]``
buffer; the destination runs the local FFI kernel over the ``EP*C`` received
rows (each row a token with top_k = 1 and its *local* expert id); the
unweighted expert outputs go back by the reverse `all_to_all`. The number of
rounds is ``max over ranks and destinations of ceil(count / C)`` (a `pmax`,
so every rank runs the same trip count): dropless whatever the imbalance,
with per-round buffers of a fixed size. The source rank combines
``y = shared(x) + sum_k w_k * out_k`` in float32 in k order, like the kernel.
The backward replays the dispatch round by round (x and dy rows go out
together), recomputes the local forward to get its residuals, runs the local
FFI backward, and returns ``dx`` rows and ``d_topk_weights`` by the reverse
`all_to_all`; expert-weight gradients accumulate over rounds in float32.
Nothing per round is saved between forward and backward (the custom_vjp
residuals are the inputs only), so activation memory does not grow with the
number of rounds.

``dispatch="peer"`` (mesh mode) replaces the rounds by one FFI call per rank in
the forward (``_ffi.peer_forward_call``) and one in the backward
(``_ffi.peer_backward_call``): the rank's kernels pull the rows routed to its
experts straight from their owners (peer pointers on GPUs, host memory on CPU
devices), push the results back and combine its own tokens
(ffi/peer_forward.h, ffi/peer_backward.h, ffi/peer_cpu.h). On CUDA the
forward also keeps round 0's gate/up pre-activations for the backward.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _ffi, _peer_ipc
from . import _validate as V
from .config import check_megakernel
from .experts import empty_shared, xla_flat

DISPATCH_MODES = ("auto", "collective", "peer")
ISSUE = "issue 5 (expert parallelism)"
# Pairs a rank may send to one destination per round, as a multiple of the
# balanced share T_local*K/EP: a factor 2 keeps balanced routing to one round
# and bounds every per-round buffer by 2*T_local*K rows (see docs/scaling.md).
ROUND_CAPACITY_FACTOR = 2.0
_EMPTY = np.int32(np.iinfo(np.int32).min)  # local-id value of an empty slot


class EPConfig(NamedTuple):
    """Static configuration of one expert-parallel call (hashable)."""
    impl: str                 # "cpu" | "cuda" | "xla": the per-rank kernel
    axis: str                 # the expert axis (all_to_all over it)
    ep: int                   # its size
    round_rows: int           # C: pairs per (source, destination) per round
    sync_axes: tuple          # axes the round count is pmax'd over
    mesh: object = None       # mesh mode only
    token_axes: tuple = ()    # mesh mode only
    psum_expert_axes: tuple = ()  # mesh mode: token axes other than `axis`
    psum_shared_axes: tuple = ()  # mesh mode: all token axes
    megakernel: object = None     # MegakernelConfig or None: the CUDA forward's knobs
    dispatch: str = "collective"  # the forward's dispatch: "collective" | "peer"
    keep: bool = True             # peer on CUDA: keep round 0's pre-activations
    peer_devices: tuple = ()      # peer: device ordinals of every group (_peer_devices)


def check_dispatch(dispatch):
    """Validates ``dispatch``; returns it ("auto" stays "auto": see _resolve_dispatch)."""
    V.check_choice("dispatch", dispatch, DISPATCH_MODES)
    return dispatch


def _resolve_dispatch(dispatch, impl, mesh, dims):
    """The dispatch a mesh call runs. "auto": "peer" when _auto_picks_peer
    says the kernels can pull over the mesh's GPUs, else "collective".
    "peer" needs a C++ kernel: CPU devices of this process, or GPUs of any
    processes (several through CUDA IPC, _peer_ipc.py)."""
    if dispatch == "auto":
        return "peer" if _auto_picks_peer(impl, mesh, dims) else "collective"
    if dispatch != "peer":
        return "collective"
    if impl not in ("cpu", "cuda"):
        raise ValueError(f"dispatch='peer' runs the library's own kernels: implementation "
                         f"resolved to {impl!r}; use implementation='cuda' (GPU) or 'cpu'")
    devices = np.asarray(mesh.devices).reshape(-1)
    foreign = [d for d in devices if d.process_index != jax.process_index()]
    if foreign and impl == "cpu":
        raise NotImplementedError(
            f"dispatch='peer' over CPU devices needs every mesh device in this process (device "
            f"{foreign[0]} is in process {foreign[0].process_index}): CPU devices of different "
            f"processes share no memory; use dispatch='collective' across processes (GPUs of "
            f"several processes use CUDA IPC)")
    return "peer"


def _auto_picks_peer(impl, mesh, dims):
    """dispatch="auto": "peer" within one host's GPUs, "collective" otherwise.

    Peer needs: the CUDA kernels (impl "cuda"), an expert axis of more than
    one rank (at EP = 1 there is nothing to pull and the collective path is
    the plain local kernel, which is faster than a peer table of one: see
    benchmarks/RESULTS.md), the peer kernels accepting the problem (dims =
    (T_local, H, F, E, K, Fs, ep)), peer-to-peer access between every pair of
    this process's mesh GPUs, and every process of the mesh on this host
    (_peer_ipc.same_host). CPU devices take "collective": "peer" on CPU is a
    test of the protocol, not a faster path."""
    devices = np.asarray(mesh.devices).reshape(-1)
    if impl != "cuda" or dims[6] < 2 or any(d.platform != "gpu" for d in devices):
        return False
    mod = _ffi._mok_cuda
    if mod.peer_forward_workspace_bytes(*dims, 0, False) == 0:
        return False
    me = jax.process_index()
    local = sorted(int(d.local_hardware_id) for d in devices if d.process_index == me)
    if mod.peer_access_problem(local):
        return False
    processes = sorted({int(d.process_index) for d in devices})
    return processes == [me] or _peer_ipc.same_host(processes, PEER_TIMEOUT_MS)


def _peer_devices(mesh, axis):
    """Every expert-axis group's devices, rank-major: the FFI call's
    ``devices`` attribute (each device finds its group and rank in it). One
    process: device ordinals. Several (or the staged path forced on GPUs):
    global device ids, which the CUDA runtime maps (_peer_ipc.py)."""
    grid = np.moveaxis(np.asarray(mesh.devices), list(mesh.axis_names).index(axis), -1)
    if jax.process_count() > 1 or (grid.flat[0].platform == "gpu" and _peer_ipc.active()):
        return tuple(int(d.id) for d in grid.reshape(-1))
    return tuple(int(d.local_hardware_id if d.local_hardware_id is not None else d.id)
                 for d in grid.reshape(-1))


# A peer that has not joined a peer call after this long is lost: the call
# fails with an error naming the ranks instead of hanging.
PEER_TIMEOUT_MS = 20000


def _round_rows(tokens_local, top_k, ep, round_rows):
    pairs = tokens_local * top_k
    if round_rows is None:
        round_rows = math.ceil(ROUND_CAPACITY_FACTOR * pairs / ep)
    if not isinstance(round_rows, (int, np.integer)) or round_rows < 1:
        raise ValueError(f"round_rows must be a positive int, got {round_rows!r}")
    return int(max(1, min(round_rows, pairs)))


def _resolve_impl(implementation, dtype, dims, platform):
    from .experts import resolve_implementation
    if implementation != "auto":
        return resolve_implementation(implementation, dtype, dims)
    if platform == "cpu":
        return "cpu"
    H, F, Fs, K = dims
    if (platform in ("gpu", "cuda") and _ffi.cuda_built()
            and _ffi.cuda_unsupported_reason(dtype, H, F, Fs, K) is None
            and _ffi.cuda_device_supported()):
        return "cuda"
    return "xla"


# --------------------------------------------------------------------------
# The per-rank local kernel (inputs as in experts._experts_ffi).

def _empty_shared(H, dtype):
    # Rank bodies always run inside shard_map (see experts.empty_shared).
    return empty_shared(H, dtype, True)


def _local_forward(impl, inputs, megakernel=None):
    inputs, _ = _ffi.reconcile_varying(list(inputs))
    if impl == "xla":
        return xla_flat(*inputs)
    return _ffi.forward_call(impl, inputs, megakernel=megakernel, keep_residuals=False)[0]


def _local_backward(impl, dy, inputs, megakernel=None):
    """(dx, d_topk_weights, dwg, dwu, dwd, dwsg, dwsu, dwsd) of the local
    kernel, recomputing its forward residuals (nothing is kept per round)."""
    (dy, *inputs), _ = _ffi.reconcile_varying([dy, *inputs])
    if impl == "xla":
        _, vjp = jax.vjp(xla_flat, *inputs)
        g = vjp(dy)
        return g[0], g[2], *g[4:]
    _, *residuals = _ffi.forward_call(impl, inputs, megakernel=megakernel)
    return tuple(_ffi.backward_call(impl, dy, inputs, residuals, megakernel=megakernel))


def _shared_inputs(impl, x, mask_u8, wsg, wsu, wsd):
    """The local kernel with one dummy routed expert of zero weight (F=0 on the
    CPU kernel; F=8 zeros on XLA and CUDA, which want non-empty tiles): its
    output is exactly the shared expert's, computed by the same code as at EP=1."""
    T, H = x.shape
    Fd = 0 if impl == "cpu" else 8
    z = jnp.zeros((1, H, Fd), x.dtype)
    return (x, jnp.zeros((T, 1), jnp.int32), jnp.zeros((T, 1), jnp.float32), mask_u8,
            z, z, jnp.zeros((1, Fd, H), x.dtype), wsg, wsu, wsd)


# --------------------------------------------------------------------------
# The per-rank dispatch plan and rounds.

def _vary(a, axes):
    """pcast `a` to vary over `axes` (no-op outside shard_map / check_vma=False)."""
    missing = tuple(sorted(frozenset(axes) - _ffi.varying_axes([a])))
    if not missing or not _tracks_vma(a):
        return a
    return jax.lax.pcast(a, missing, to="varying")


def _tracks_vma(a):
    return getattr(jax.typeof(a), "manual_axis_type", None) is not None


class _Plan(NamedTuple):
    order: jax.Array      # [P] pairs sorted by destination rank, then pair index
    start: jax.Array      # [EP] first sorted position of each destination
    counts: jax.Array     # [EP] pairs sent to each destination
    valid: jax.Array      # [P] bool: unmasked pair
    local_id: jax.Array   # [P] expert id on the destination rank
    rounds: jax.Array     # scalar int32, the same on every rank of the group


def _plan(cfg, ids, mask, experts_local):
    T, K = ids.shape
    ep, C = cfg.ep, cfg.round_rows
    flat = ids.reshape(-1)
    # Pairs with ids outside [0, E) are skipped, as the CUDA kernel does: an
    # error raised by one rank's kernel would leave the others waiting in the
    # next all_to_all.
    valid = jnp.repeat(mask, K) & (flat >= 0) & (flat < experts_local * ep)
    dest = jnp.where(valid, flat // experts_local, ep).astype(jnp.int32)
    counts = jnp.bincount(dest, length=ep + 1)[:ep].astype(jnp.int32)
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)
    start = (jnp.cumsum(counts) - counts).astype(jnp.int32)
    local_rounds = (jnp.max(counts) + C - 1) // C
    rounds = jax.lax.pmax(local_rounds, cfg.sync_axes)
    return _Plan(order, start, counts, valid, (flat % experts_local).astype(jnp.int32), rounds)


def _send_pairs(cfg, plan, j):
    """Pair index of every slot [EP*C] of round j (-1: empty slot): slot
    d*C + i carries the (j*C + i)-th pair (in pair order) routed to rank d."""
    C = cfg.round_rows
    r = j * C + jnp.arange(C, dtype=jnp.int32)[None, :]
    ok = r < plan.counts[:, None]
    at = jnp.clip(plan.start[:, None] + r, 0, plan.order.shape[0] - 1)
    return jnp.where(ok, plan.order[at], -1).reshape(-1)


def _a2a(a, cfg):
    return jax.lax.all_to_all(a, cfg.axis, 0, 0, tiled=True)


def _gather_rows(a, idx):
    """a[idx] with zero rows where idx < 0."""
    safe = jnp.clip(idx, 0, a.shape[0] - 1)
    rows = a[safe]
    keep = (idx >= 0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros((), rows.dtype))


def _scatter_pairs(buf, pair, vals):
    """buf[pair[s]] = vals[s] for the filled slots (each pair travels once)."""
    idx = jnp.where(pair >= 0, pair, buf.shape[0])
    return buf.at[idx].set(vals.astype(buf.dtype), mode="drop")


def _union_axes(arrays):
    return tuple(sorted(_ffi.varying_axes(arrays)))


def rank_forward(cfg, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd):
    """Per-rank forward (inside a manual context over cfg.axis)."""
    if cfg.dispatch == "peer":
        return _peer_rank_forward(cfg, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd)[0]
    T, H = x.shape
    K = ids.shape[1]
    El = wg.shape[0]
    axes = _union_axes([x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd])
    plan = _plan(cfg, ids, mask, El)
    mask_u8 = mask.astype(jnp.uint8)

    def body(j, out):
        pair = _send_pairs(cfg, plan, j)
        rows = _gather_rows(x, jnp.where(pair >= 0, pair // K, -1))
        meta = jnp.where(pair >= 0, plan.local_id[jnp.clip(pair, 0)], _EMPTY)
        rows, meta = _a2a(rows, cfg), _a2a(meta, cfg)
        live = meta != _EMPTY
        y_rows = _local_forward(cfg.impl, (
            rows, jnp.where(live, meta, 0)[:, None],
            jnp.ones((rows.shape[0], 1), jnp.float32), live.astype(jnp.uint8),
            wg, wu, wd, *_empty_shared(H, x.dtype)), cfg.megakernel)
        back = _a2a(y_rows, cfg)  # slot s holds the output of pair[s]
        return _scatter_pairs(out, pair, back)

    out0 = _vary(jnp.zeros((T * K, H), x.dtype), axes)
    out = jax.lax.fori_loop(0, plan.rounds, body, out0)

    acc = jnp.zeros((T, H), jnp.float32)
    if wsg.shape[1]:
        acc = _local_forward(cfg.impl, _shared_inputs(cfg.impl, x, mask_u8, wsg, wsu, wsd),
                             cfg.megakernel)
        acc = acc.astype(jnp.float32)
    out = out.reshape(T, K, H).astype(jnp.float32)
    valid = plan.valid.reshape(T, K)
    w = weights.astype(jnp.float32)
    for k in range(K):  # the kernel's combine: shared first, then k = 0..K-1
        # The barrier keeps XLA from contracting w*out + acc into an FMA, which
        # would round differently from the kernel's separate multiply and add.
        prod = jax.lax.optimization_barrier(w[:, k:k + 1] * out[:, k])
        acc = jnp.where(valid[:, k:k + 1], acc + prod, acc)
    y = jnp.where(mask[:, None], acc, 0.0).astype(x.dtype)
    return _vary(y, axes)


def _peer_rank_forward(cfg, x, ids, weights, mask, *weights_all):
    """The peer dispatch: one FFI call per rank pulls the rows routed to this
    rank's experts from their owners, pushes the results back and combines
    its own tokens (ffi/peer_cpu.h on CPU devices, ffi/peer_forward.h on GPUs).
    Returns (y, kept): on CUDA, round 0's gate/up pre-activations for the
    backward (a balanced load then recomputes nothing); () on CPU."""
    inputs = [x, ids, weights, mask.astype(jnp.uint8), *weights_all]
    axes = _union_axes(inputs)
    inputs, _ = _ffi.reconcile_varying(inputs)
    y, kept = _ffi.peer_forward_call(cfg.impl, inputs, cfg.peer_devices, cfg.ep, PEER_TIMEOUT_MS)
    return _vary(y, axes), tuple(_vary(k, axes) for k in kept)


def _rank_forward_kept(cfg, *inputs):
    """(y, *kept) of one rank: the mesh forward's outputs (kept feeds the backward)."""
    if cfg.dispatch == "peer":
        y, kept = _peer_rank_forward(cfg, *inputs)
        return (y, *kept[:_n_kept(cfg)])
    return (rank_forward(cfg, *inputs),)


def _n_kept(cfg):
    return 2 if cfg.dispatch == "peer" and cfg.impl == "cuda" and cfg.keep else 0


def _peer_rank_backward(cfg, dy, x, ids, weights, mask, *weights_all, kept=()):
    """The peer dispatch's backward: one FFI call per rank pulls x and dy rows
    for its experts, recomputes their pre-activations, writes its experts'
    weight gradients and pushes every d_x row and d_topk_weight back to its
    owner, who combines them with its shared expert's."""
    inputs = [dy, x, ids, weights, mask.astype(jnp.uint8), *weights_all, *kept]
    axes = _union_axes(inputs)
    (dy, *inputs), _ = _ffi.reconcile_varying(inputs)
    inputs, kept = inputs[:10], inputs[10:]
    if cfg.impl == "cuda" and not kept:  # recompute: zero-size, nothing kept
        F = inputs[4].shape[2]
        kept = [_vary(jnp.zeros((0, F), inputs[0].dtype), axes)] * 2
    g = _ffi.peer_backward_call(cfg.impl, dy, inputs, kept, cfg.peer_devices, cfg.ep,
                                PEER_TIMEOUT_MS)
    dx, dw = g[0], g[1]
    return tuple(_vary(a, axes) for a in (dx, dw, *(w.astype(jnp.float32) for w in g[2:])))


def rank_backward(cfg, dy, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd, kept=()):
    """Per-rank backward: (dx, d_topk_weights, dwg, dwu, dwd, dwsg, dwsu, dwsd),
    float32 accumulators for the weights, before any cross-rank sum. kept:
    what the forward kept for it (peer dispatch on CUDA only)."""
    if cfg.dispatch == "peer":
        return _peer_rank_backward(cfg, dy, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd,
                                   kept=kept)
    T, H = x.shape
    K = ids.shape[1]
    El = wg.shape[0]
    axes = _union_axes([dy, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd])
    plan = _plan(cfg, ids, mask, El)
    mask_u8 = mask.astype(jnp.uint8)
    w_flat = weights.reshape(-1).astype(jnp.float32)

    def body(j, carry):
        dx_p, dw_p, gg, gu, gd = carry
        pair = _send_pairs(cfg, plan, j)
        tok = jnp.where(pair >= 0, pair // K, -1)
        rows = _a2a(jnp.concatenate([_gather_rows(x, tok), _gather_rows(dy, tok)], 1), cfg)
        meta = _a2a(jnp.where(pair >= 0, plan.local_id[jnp.clip(pair, 0)], _EMPTY), cfg)
        wr = _a2a(jnp.where(pair >= 0, w_flat[jnp.clip(pair, 0)], 0.0), cfg)
        live = meta != _EMPTY
        inputs = (rows[:, :H], jnp.where(live, meta, 0)[:, None], wr[:, None],
                  live.astype(jnp.uint8), wg, wu, wd, *_empty_shared(H, x.dtype))
        dxr, dwr, dgg, dgu, dgd = _local_backward(cfg.impl, rows[:, H:], inputs,
                                                  cfg.megakernel)[:5]
        dx_back = _a2a(dxr, cfg)
        dw_back = _a2a(dwr.reshape(-1), cfg)
        dx_p = _scatter_pairs(dx_p, pair, dx_back)
        dw_p = _scatter_pairs(dw_p, pair, dw_back)
        return (dx_p, dw_p, gg + dgg.astype(jnp.float32), gu + dgu.astype(jnp.float32),
                gd + dgd.astype(jnp.float32))

    init = (jnp.zeros((T * K, H), x.dtype), jnp.zeros((T * K,), jnp.float32),
            jnp.zeros(wg.shape, jnp.float32), jnp.zeros(wu.shape, jnp.float32),
            jnp.zeros(wd.shape, jnp.float32))
    init = tuple(_vary(a, axes) for a in init)
    dx_p, dw_p, gg, gu, gd = jax.lax.fori_loop(0, plan.rounds, body, init)

    acc = jnp.zeros((T, H), jnp.float32)
    dsh = tuple(jnp.zeros(a.shape, jnp.float32) for a in (wsg, wsu, wsd))
    if wsg.shape[1]:
        g = _local_backward(cfg.impl, dy, _shared_inputs(cfg.impl, x, mask_u8, wsg, wsu, wsd),
                            cfg.megakernel)
        acc = g[0].astype(jnp.float32)
        dsh = tuple(a.astype(jnp.float32) for a in g[5:])
    dx_p = dx_p.reshape(T, K, H).astype(jnp.float32)
    valid = plan.valid.reshape(T, K)
    for k in range(K):  # the kernel's dx combine: shared first, then k order
        acc = jnp.where(valid[:, k:k + 1], acc + dx_p[:, k], acc)
    dx = jnp.where(mask[:, None], acc, 0.0).astype(x.dtype)
    dw = jnp.where(plan.valid, dw_p, 0.0).reshape(T, K)
    return tuple(_vary(a, axes) for a in (dx, dw, gg, gu, gd, *dsh))


def _cast_like(grads, primals):
    return tuple(g.astype(p.dtype) for g, p in zip(grads, primals))


# --------------------------------------------------------------------------
# Inside the caller's shard_map (axis_name=).

@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ep_inner(cfg, *inputs):
    return rank_forward(cfg, *inputs)


def _ep_inner_fwd(cfg, *inputs):
    return rank_forward(cfg, *inputs), inputs


def _ep_inner_bwd(cfg, inputs, dy):
    x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd = inputs
    dx, dw, gg, gu, gd, gsg, gsu, gsd = rank_backward(cfg, dy, *inputs)
    dx, gg, gu, gd, gsg, gsu, gsd = _cast_like(
        (dx, gg, gu, gd, gsg, gsu, gsd), (x, wg, wu, wd, wsg, wsu, wsd))
    return dx, None, dw, None, gg, gu, gd, gsg, gsu, gsd


_ep_inner.defvjp(_ep_inner_fwd, _ep_inner_bwd)


# --------------------------------------------------------------------------
# Global arrays over a mesh (mesh=).

def _specs(cfg):
    tok = P(cfg.token_axes, None)
    ew = P(cfg.axis, None, None)
    return (tok, tok, tok, P(cfg.token_axes), ew, ew, ew, P(), P(), P())


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ep_mesh(cfg, *inputs):
    return _ep_mesh_fwd(cfg, *inputs)[0]


def _kept_spec(cfg):
    return P(cfg.token_axes, None)  # one [round_rows, F] block per token shard


def _ep_mesh_fwd(cfg, *inputs):
    specs = _specs(cfg)
    # jit: an eager shard_map would compile each op alone (and jax 0.11.2's
    # Shardy pass crashes on some of those single-op computations).
    f = jax.jit(jax.shard_map(partial(_rank_forward_kept, cfg), mesh=cfg.mesh, in_specs=specs,
                              out_specs=(specs[0],) + (_kept_spec(cfg),) * _n_kept(cfg)))
    y, *kept = f(*inputs)
    return y, (inputs, tuple(kept))


def _mesh_rank_backward(cfg, dy, *operands):
    inputs, kept = operands[:10], operands[10:]
    dx, dw, gg, gu, gd, gsg, gsu, gsd = rank_backward(cfg, dy, *inputs, kept=kept)
    if cfg.psum_expert_axes:  # expert weights are replicated over the data axes
        gg, gu, gd = (jax.lax.psum(a, cfg.psum_expert_axes) for a in (gg, gu, gd))
    gsg, gsu, gsd = (jax.lax.psum(a, cfg.psum_shared_axes) for a in (gsg, gsu, gsd))
    x, wg, wu, wd, wsg, wsu, wsd = (inputs[i] for i in (0, 4, 5, 6, 7, 8, 9))
    return (dx.astype(x.dtype), dw,
            *_cast_like((gg, gu, gd, gsg, gsu, gsd), (wg, wu, wd, wsg, wsu, wsd)))


def _ep_mesh_bwd(cfg, res, dy):
    inputs, kept = res
    specs = _specs(cfg)
    out_specs = (specs[0], specs[2], *specs[4:])
    f = jax.jit(jax.shard_map(partial(_mesh_rank_backward, cfg), mesh=cfg.mesh,
                              in_specs=(specs[0], *specs) + (_kept_spec(cfg),) * len(kept),
                              out_specs=out_specs))
    dx, dw, gg, gu, gd, gsg, gsu, gsd = f(dy, *inputs, *kept)
    return dx, None, dw, None, gg, gu, gd, gsg, gsu, gsd


_ep_mesh.defvjp(_ep_mesh_fwd, _ep_mesh_bwd)


# --------------------------------------------------------------------------
# Entry points.

def _check_common(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_experts,
                  token_mask):
    f = V.flatten_experts_args(x, topk_ids, topk_weights, w_gate, w_up, w_down,
                               shared_experts, token_mask)
    E_l, H, F, K, T = f.dims
    wsg, wsu, wsd = f.shared if f.shared is not None else _empty_shared(H, f.x.dtype)
    return f.x, (f.x2, f.ids2, f.w2, f.mask2, w_gate, w_up, w_down, wsg, wsu, wsd), f.dims


def mesh_axes(mesh, expert_axis, token_axes):
    """Validated (expert_axis, token_axes tuple, EP size) for a mesh."""
    names = tuple(getattr(mesh, "axis_names", ()))
    if not names:
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if expert_axis is None:
        raise ValueError(f"expert_axis is required with mesh=; the mesh has axes {names}")
    if expert_axis not in names:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh "
                         f"(its axes are {names})")
    if token_axes is None:
        token_axes = (expert_axis,) + tuple(a for a in names if a != expert_axis)
    elif isinstance(token_axes, str):
        token_axes = (token_axes,)
    token_axes = tuple(token_axes)
    for a in token_axes:
        if a not in names:
            raise ValueError(f"token_axes contains {a!r}, which is not an axis of the mesh "
                             f"(its axes are {names})")
    if len(set(token_axes)) != len(token_axes):
        raise ValueError(f"token_axes={token_axes} names an axis twice")
    if expert_axis not in token_axes:
        raise ValueError(f"token_axes={token_axes} must include expert_axis={expert_axis!r}: "
                         "tokens are split over the expert axis, each rank sending its own")
    return expert_axis, token_axes, int(mesh.shape[expert_axis])


def experts_parallel(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, mesh=None,
                     expert_axis=None, token_axes=None, axis_name=None, shared_experts=None,
                     token_mask=None, implementation="auto", dispatch="auto",
                     round_rows=None, megakernel=None, recompute=False):
    """`mok_jax.experts` with the experts sharded over a mesh axis.

    Either ``mesh`` + ``expert_axis`` (global arrays; w_* are ``[E, ...]`` and
    are split along E) or ``axis_name`` (inside the caller's shard_map; w_*
    are this rank's ``[E/EP, ...]`` block, expert ``e`` living on rank
    ``e // (E/EP)``, and topk_ids are global ids). ``round_rows``: pairs per
    (source, destination) per dispatch round (default
    ``ceil(2*T_local*K/EP)``, see docs/scaling.md). ``megakernel``: None or a
    `mok_jax.MegakernelConfig` for the per-rank CUDA forward (also the
    forward the backward recomputes); ignored by the "cpu" and "xla" kernels.
    ``recompute``: with dispatch="peer" on CUDA, keep nothing for the backward
    (by default round 0's gate/up pre-activations are kept, so a balanced
    load recomputes nothing); every other path keeps only the inputs.
    """
    check_dispatch(dispatch)
    megakernel = check_megakernel(megakernel)
    if (mesh is None) == (axis_name is None):
        raise ValueError("give exactly one of mesh= (global arrays) or axis_name= "
                         "(inside your own shard_map)")
    x, inputs, (E, H, F, K, T) = _check_common(x, topk_ids, topk_weights, w_gate, w_up,
                                               w_down, shared_experts, token_mask)
    Fs = inputs[7].shape[1]
    if mesh is not None:
        axis, tok_axes, ep = mesh_axes(mesh, expert_axis, token_axes)
        if E % ep:
            raise ValueError(f"w_gate has E={E} experts, which does not divide evenly over "
                             f"expert_axis={axis!r} of size {ep}")
        n_tok = math.prod(int(mesh.shape[a]) for a in tok_axes)
        if T % n_tok:
            raise ValueError(f"x has T={T} tokens, which do not divide evenly over "
                             f"token_axes={tok_axes} ({n_tok} shards)")
        platform = np.asarray(mesh.devices).flat[0].platform
        impl = _resolve_impl(implementation, x.dtype, (H, F, Fs, K), platform)
        if T == 0:
            return jnp.zeros(x.shape, x.dtype)
        mode = _resolve_dispatch(dispatch, impl, mesh, (T // n_tok, H, F, E, K, Fs, ep))
        cfg = EPConfig(impl=impl, axis=axis, ep=ep,
                       round_rows=_round_rows(T // n_tok, K, ep, round_rows),
                       sync_axes=tok_axes, mesh=mesh, token_axes=tok_axes,
                       psum_expert_axes=tuple(a for a in tok_axes if a != axis),
                       psum_shared_axes=tok_axes, megakernel=megakernel, dispatch=mode,
                       keep=not V.check_bool("recompute", recompute),
                       peer_devices=_peer_devices(mesh, axis) if mode == "peer" else ())
        with jax.named_scope(f"mok_experts_ep_{impl}"):
            y = _ep_mesh(cfg, *inputs)
        return y.reshape(x.shape)

    if expert_axis is not None or token_axes is not None:
        raise ValueError("expert_axis= and token_axes= go with mesh=; inside your own "
                         "shard_map pass axis_name= only")
    if dispatch == "peer":
        raise NotImplementedError(
            "dispatch='peer' needs mesh=: the peer call must know the devices of every expert "
            "group, which a shard_map body (axis_name=) does not expose; inside your own "
            "shard_map use dispatch='collective' (or 'auto')")
    ep = int(jax.lax.axis_size(axis_name))
    impl = _resolve_impl(implementation, x.dtype, (H, F, Fs, K), jax.default_backend())
    if T == 0:
        return jnp.zeros(x.shape, x.dtype)
    cfg = EPConfig(impl=impl, axis=axis_name, ep=ep,
                   round_rows=_round_rows(T, K, ep, round_rows),
                   sync_axes=(axis_name,), megakernel=megakernel)
    inputs, _ = _ffi.reconcile_varying(list(inputs))
    with jax.named_scope(f"mok_experts_ep_{impl}"):
        y = _ep_inner(cfg, *inputs)
    return y.reshape(x.shape)
