"""Loads the compiled backends and exposes their FFI targets as JAX functions.

`_mok_cpu` is always built; `_mok_cuda` only where nvcc was found at build
time. A missing or unloadable CUDA module leaves the CUDA backend unavailable
(with the reason kept for `mok_jax.info`) and never breaks import.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from . import _peer_ipc
from .config import MegakernelConfig

# The order of forward_workspace_bytes' knob arguments after (T, H, F, E, K, Fs).
_MEGAKERNEL_ATTRS = ("persistent", "dispatch_ctas", "minibatch_rows", "ring_rows")

try:
    from . import _mok_cpu
except ImportError as err:
    raise ImportError(
        "mok_jax's compiled CPU module (_mok_cpu) was not found next to "
        f"{__file__}. Importing the source tree without a build? Install with "
        "`pip install -e .` (the README's command), which maps the package to its "
        "build; a non-editable install is shadowed when run from the repository root."
    ) from err

TILE_ROWS = int(_mok_cpu.tile_rows)

for _name, _capsule in _mok_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

try:
    from . import _mok_cuda  # noqa: F401
except ImportError as err:  # not built here, or libcudart/driver missing
    _mok_cuda = None
    CUDA_UNAVAILABLE_REASON = f"the CUDA backend could not be imported: {err}"
else:
    CUDA_UNAVAILABLE_REASON = None
    for _name, _capsule in _mok_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cuda_built() -> bool:
    return _mok_cuda is not None


def cuda_unsupported_reason(dtype, H, F, Fs, K):
    """Why the CUDA kernels cannot take this problem (None when they can)."""
    if np.dtype(dtype) != jnp.bfloat16:
        return f"the CUDA backend supports bfloat16 only, got {np.dtype(dtype).name}"
    for name, v in (("H", H), ("F", F), ("Fs", Fs)):
        if v % 8:
            return f"the CUDA backend needs {name} to be a multiple of 8 (16-byte rows), got {v}"
    if K > 64:
        return f"the CUDA backend supports top_k <= 64, got {K}"
    return None


def cuda_device_supported() -> bool:
    """The CUDA kernels are built for sm_90a (Hopper) only."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(str(getattr(d, "compute_capability", "")).startswith("9.0") for d in devices)


def row_capacity(tokens: int, top_k: int, experts: int) -> int:
    """Static bound on the padded expert-major rows (plan.h Problem::row_capacity)."""
    rows = tokens * top_k + experts * (TILE_ROWS - 1)
    return -(-rows // TILE_ROWS) * TILE_ROWS


# jax 0.11.2's Shardy pass segfaults (ManualComputationUnusedInputsPattern) on
# zero-size operands of an FFI call run eagerly inside shard_map; fixed in
# 0.12. There no zero-size buffer enters or leaves an FFI call inside
# shard_map (experts.empty_shared, forward_call's kept residuals).
ZERO_SIZE_OPERANDS_CRASH = tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 12)

# A forward that nothing differentiates skips its residuals (the CUDA
# kernels' activation-only gate/up epilogue) unless
# MOK_JAX_CUDA_DROP_RESIDUALS=0 (read at import; CUDA only).
CUDA_DROPS_RESIDUALS = os.environ.get("MOK_JAX_CUDA_DROP_RESIDUALS", "1") != "0"


def varying_axes(arrays):
    axes = set()
    for a in arrays:
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        if mat is not None:
            axes |= set(mat.varying)
    return frozenset(axes)


def reconcile_varying(arrays):
    """Inside shard_map, makes every array vary over the union of the inputs'
    varying axes (a no-communication pcast whose transpose is a psum), so the
    FFI results and the custom_vjp cotangents have consistent types."""
    axes = varying_axes(arrays)
    if not axes:
        return list(arrays), axes
    out = []
    for a in arrays:
        missing = tuple(sorted(axes - varying_axes([a])))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out, axes


def _result(shape, dtype, like):
    """A result type that varies over the same shard_map axes as `like` (a
    bare ShapeDtypeStruct would be typed invariant, which is unsound)."""
    return jax.typeof(like).update(shape=tuple(shape), dtype=np.dtype(dtype), weak_type=False)


def forward_result_types(x, topk_ids, w_gate, ws_gate, keep_pre=True):
    """keep_pre=False: the four pre-activation results get 0 rows (the kernels
    then write the activations only)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, _, F = w_gate.shape
    Fs = ws_gate.shape[1]
    R = row_capacity(T, K, E)
    Rp, Tp = (R, T) if keep_pre else (0, 0)
    i32 = jnp.int32
    return (
        _result((T, H), x.dtype, x),        # y
        _result((E + 1,), i32, x),          # expert_offsets
        _result((R,), i32, x),              # row_pair
        _result((T * K,), i32, x),          # pair_row
        _result((Rp, F), x.dtype, x),       # gate_pre
        _result((Rp, F), x.dtype, x),       # up_pre
        _result((Tp, Fs), x.dtype, x),      # shared_gate_pre
        _result((Tp, Fs), x.dtype, x),      # shared_up_pre
    )


def backward_result_types(x, topk_ids, weights):
    """dx, d_topk_weights (float32), then one gradient per weight."""
    return (_result(x.shape, x.dtype, x), _result(topk_ids.shape, np.float32, x),
            *(_result(w.shape, w.dtype, x) for w in weights))


def forward_call(platform, inputs, megakernel=None, keep_residuals=True):
    """inputs: (x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd), already
    reconciled (reconcile_varying) when inside shard_map. megakernel: a
    MegakernelConfig or None (the defaults), used by the CUDA target only.
    keep_residuals=False (a forward nothing differentiates): the gate/up
    pre-activations are neither written nor allocated, 2 R F + 2 T Fs
    elements of stores and memory saved (on CUDA unless CUDA_DROPS_RESIDUALS
    is off, and never by the persistent megakernel). Returns y and the 7
    residuals (those four then with 0 rows)."""
    x, ids, _, _, wg, _, _, wsg, _, _ = inputs
    cuda_keeps = platform == "cuda" and (not CUDA_DROPS_RESIDUALS
                                         or (megakernel or MegakernelConfig()).persistent)
    keep_pre = keep_residuals or cuda_keeps or (ZERO_SIZE_OPERANDS_CRASH and bool(varying_axes(inputs)))
    types = forward_result_types(x, ids, wg, wsg, keep_pre=keep_pre)
    attrs = {}
    if platform == "cuda":  # the device workspace is one more XLA-owned output
        attrs = (megakernel or MegakernelConfig()).ffi_attrs()
        T, H = x.shape
        E, _, F = wg.shape
        # The workspace holds the ring and the ready counters, so it depends on the knobs.
        nbytes = _mok_cuda.forward_workspace_bytes(
            T, H, F, E, ids.shape[1], wsg.shape[1], *(int(attrs[k]) for k in _MEGAKERNEL_ATTRS))
        types = (*types, _result((nbytes,), np.uint8, x))
    outs = jax.ffi.ffi_call(f"mok_experts_fwd_{platform}", types,
                            vmap_method="sequential")(*inputs, **attrs)
    return outs[:8]


# Operand positions of the backward call's gate/up residuals (after dy, the 10
# inputs and offsets, row_pair, pair_row) and of the CUDA results aliased with
# them (after the 8 gradients and the workspace).
_BWD_PRE_OPERANDS = (14, 15, 16, 17)
_BWD_PRE_RESULTS = (9, 10, 11, 12)


def backward_call(platform, dy, inputs, residuals, megakernel=None):
    """megakernel: a MegakernelConfig or None; its persistent_backward picks
    the CUDA backward's megakernel (the CPU target ignores it)."""
    x, ids = inputs[0], inputs[1]
    types = backward_result_types(x, ids, inputs[4:])
    aliases, attrs = {}, {}
    if platform == "cuda":
        attrs = (megakernel or MegakernelConfig()).backward_ffi_attrs()
        # The device workspace is one more XLA-owned output; four more results
        # alias the gate/up residuals, which the backward overwrites with the
        # gate/up gradient rows (they are spent by then): 2 R F + 2 T Fs
        # elements fewer at the step's peak. XLA copies a residual first when
        # it is still live elsewhere (e.g. a vjp called twice).
        T, H = x.shape
        wg, wsg = inputs[4], inputs[7]
        E, _, F = wg.shape
        Fs = wsg.shape[1]
        # The workspace layout depends on the mode (the megakernel keeps every row there).
        nbytes = _mok_cuda.backward_workspace_bytes(T, H, F, E, ids.shape[1], Fs,
                                                    bool(attrs["persistent"]))
        pre = residuals[3:7]  # gate_pre, up_pre, shared_gate_pre, shared_up_pre
        types = (*types, _result((nbytes,), np.uint8, x), *(jax.typeof(r) for r in pre))
        n_alias = 4 if Fs > 0 else 2  # zero-size shared buffers stay unaliased
        aliases = dict(zip(_BWD_PRE_OPERANDS[:n_alias], _BWD_PRE_RESULTS[:n_alias]))
    outs = jax.ffi.ffi_call(f"mok_experts_bwd_{platform}", types, vmap_method="sequential",
                            input_output_aliases=aliases)(dy, *inputs, *residuals, **attrs)
    return outs[:8]


def _peer_attrs(devices, ranks, timeout_ms):
    return dict(devices=np.asarray(devices, np.int32), ranks=np.int32(ranks),
                timeout_ms=np.int32(timeout_ms))


def _peer_cuda_dims(inputs, ranks, round_rows):
    """The (T, H, F, E, K, Fs, ranks, round_rows) of a CUDA peer call, as the
    _mok_cuda.peer_* size functions take them (E global)."""
    x, ids, wg, wsg = inputs[0], inputs[1], inputs[4], inputs[7]
    E_l, _, F = wg.shape
    return (*x.shape, F, E_l * ranks, ids.shape[1], wsg.shape[1], ranks, round_rows)


def _peer_cuda_setup(devices, dims, timeout_ms):
    """Several processes (or MOK_JAX_PEER_STAGING=1): stage and map the
    group's devices (_peer_ipc.py)."""
    if _peer_ipc.active():
        _peer_ipc.ensure(devices, dims, timeout_ms)


def _peer_workspace(size_fn, dims):
    # Staged calls keep their return rows in the IPC staging, not here.
    nbytes = size_fn(*dims, _peer_ipc.active())
    if nbytes == 0:
        T, H, F, E, _, _, ranks, round_rows = dims
        raise ValueError(f"dispatch='peer': the CUDA peer kernels reject this problem "
                         f"(T={T}, H={H}, F={F}, E={E}, ranks={ranks}, round_rows={round_rows})")
    return nbytes


def peer_forward_call(platform, inputs, devices, ranks, timeout_ms, round_rows=0):
    """The peer-dispatch forward of one rank (ffi/peer_cpu.h, ffi/peer_forward.h).

    inputs as in forward_call, w_* holding this rank's E/ranks experts and
    topk_ids global ids. devices: the device ordinals of every expert-axis
    group, rank-major ([groups * ranks]); the handler finds its own. Returns
    (y, kept): kept is round 0's gate/up pre-activations ([round_rows, F]
    each) on CUDA, for peer_backward_call, and () on CPU (which recomputes).
    """
    x = inputs[0]
    types = [_result(x.shape, x.dtype, x)]
    attrs = _peer_attrs(devices, ranks, timeout_ms)
    if platform == "cuda":
        dims = _peer_cuda_dims(inputs, ranks, round_rows)
        _peer_cuda_setup(devices, dims, timeout_ms)
        nbytes = _peer_workspace(_mok_cuda.peer_forward_workspace_bytes, dims)
        C, F = _mok_cuda.peer_round_rows(*dims), dims[2]
        types += [_result((nbytes,), np.uint8, x), _result((C, F), x.dtype, x),
                  _result((C, F), x.dtype, x)]
        attrs["round_rows"] = np.int32(round_rows)
    outs = jax.ffi.ffi_call(f"mok_peer_fwd_{platform}", types,
                            vmap_method="sequential")(*inputs, **attrs)
    return outs[0], tuple(outs[2:])


def peer_backward_call(platform, dy, inputs, kept, devices, ranks, timeout_ms, round_rows=0):
    """The peer-dispatch backward of one rank (ffi/peer_cpu.h, ffi/peer_backward.h):
    kept is the forward's (same round_rows; on CUDA zero-size arrays when
    nothing was kept); what it did not keep is recomputed. Returns dx,
    d_topk_weights and the 6 weight gradients (this rank's experts; the shared
    expert's for this rank's tokens only, to be summed over the token axes)."""
    x, ids = inputs[0], inputs[1]
    types = list(backward_result_types(x, ids, inputs[4:]))
    attrs = _peer_attrs(devices, ranks, timeout_ms)
    if platform == "cuda":
        dims = _peer_cuda_dims(inputs, ranks, round_rows)
        _peer_cuda_setup(devices, dims, timeout_ms)
        types.append(_result((_peer_workspace(_mok_cuda.peer_backward_workspace_bytes, dims),),
                             np.uint8, x))
        attrs["round_rows"] = np.int32(round_rows)
    outs = jax.ffi.ffi_call(f"mok_peer_bwd_{platform}", types,
                            vmap_method="sequential")(dy, *inputs, *kept, **attrs)
    return tuple(outs[:8])
