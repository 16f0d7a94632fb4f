"""`experts`: steps 3-4 of the layer (expert FFNs + combine) for given routing,
the level of the megakernel, with one implementation switch."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import _ffi
from . import _validate as V
from .config import check_megakernel
from .reference import experts_xla


def empty_shared(H, dtype, in_shard_map):
    """The (ws_gate, ws_up, ws_down) that stand for "no shared expert" (inside
    shard_map on jax < 0.12, see _ffi.ZERO_SIZE_OPERANDS_CRASH: a zero-weight
    shared expert of width 8, which adds exact zeros, ~8/(k*F) extra FLOPs)."""
    Fs = 8 if (in_shard_map and _ffi.ZERO_SIZE_OPERANDS_CRASH) else 0
    z = jnp.zeros((H, Fs), dtype)
    return z, z, jnp.zeros((Fs, H), dtype)


# megakernel (a MegakernelConfig or None) is static like platform: it changes
# the CUDA kernel's launch, never the values, and is hashable for the jit cache.
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _experts_ffi(platform, megakernel, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd):
    # Not differentiated (inference, evaluation): no residuals to keep.
    return _forward(platform, megakernel, x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd,
                    keep_residuals=False)[0]


def _forward(platform, megakernel, *inputs, keep_residuals=True):
    # experts() reconciled the inputs
    y, *residuals = _ffi.forward_call(platform, inputs, megakernel=megakernel,
                                      keep_residuals=keep_residuals)
    return y, tuple(residuals)


def _experts_ffi_fwd(platform, megakernel, *inputs):
    y, residuals = _forward(platform, megakernel, *inputs)
    # The routed outputs are not saved: only x, routing, weights, the schedule
    # and the gate/up pre-activations (named so remat policies can pick them).
    residuals = tuple(checkpoint_name(r, "mok_experts_residual")
                      for r in residuals)
    return y, (inputs, residuals)


def _experts_ffi_bwd(platform, megakernel, saved, dy):
    inputs, residuals = saved
    (dy, *inputs), _ = _ffi.reconcile_varying([dy, *inputs])
    dx, dw, dwg, dwu, dwd, dwsg, dwsu, dwsd = _ffi.backward_call(platform, dy, inputs, residuals,
                                                                        megakernel=megakernel)
    return dx, None, dw, None, dwg, dwu, dwd, dwsg, dwsu, dwsd


_experts_ffi.defvjp(_experts_ffi_fwd, _experts_ffi_bwd)


def xla_flat(x, ids, weights, mask, wg, wu, wd, wsg, wsu, wsd):
    """The XLA reference on the FFI kernels' flat argument list."""
    shared = None if wsg.shape[1] == 0 else (wsg, wsu, wsd)
    return experts_xla(x, ids, weights, mask.astype(bool), wg, wu, wd, shared)


def resolve_implementation(implementation, dtype, dims=None):
    """The concrete backend ("xla", "cpu" or "cuda") for a request.

    dims: (H, F, Fs, K) of the problem, for the CUDA backend's shape limits;
    None checks the dtype only."""
    V.check_choice("implementation", implementation, V.IMPLEMENTATIONS)
    H, F, Fs, K = dims if dims is not None else (8, 8, 0, 1)
    cuda_reason = _ffi.cuda_unsupported_reason(dtype, H, F, Fs, K)
    if implementation == "cuda":
        if not _ffi.cuda_built():
            raise ValueError(
                "implementation='cuda' needs mok_jax's CUDA backend, which is unavailable: "
                f"{_ffi.CUDA_UNAVAILABLE_REASON}. Rebuild on a machine with nvcc "
                "(pip install -e . with MOK_JAX_CUDA=ON), or use implementation='auto'.")
        if cuda_reason:
            raise NotImplementedError(
                f"implementation='cuda': {cuda_reason}; use implementation='auto' (falls back "
                "to 'xla') or 'xla'")
    if implementation != "auto":
        return implementation
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend in ("gpu", "cuda") and _ffi.cuda_built() and cuda_reason is None \
            and _ffi.cuda_device_supported():
        return "cuda"
    return "xla"


def experts(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, shared_experts=None,
            token_mask=None, implementation="auto", megakernel=None, recompute=False):
    """Expert FFNs and combine for given routing: steps 3-4 of `moe_layer`.

    Args:
      x: tokens ``[..., H]`` (float32 or bfloat16); leading axes are flattened.
      topk_ids: ``[..., K]`` int32 expert ids in ``[0, E)``.
      topk_weights: ``[..., K]`` combine weights (computed in float32).
      w_gate, w_up: ``[E, H, F]``; w_down: ``[E, F, H]``, all in x's dtype.
      shared_experts: None, ``(ws_gate[H, Fs], ws_up[H, Fs], ws_down[Fs, H])``,
        or a list of such tuples (they add).
      token_mask: optional bool ``[...]``; False marks padding tokens, which are
        not dispatched and whose output is exactly zero.
      implementation: "auto", "xla", "cpu" or "cuda" (see `moe_layer`).
      megakernel: None or a `mok_jax.MegakernelConfig`: how the CUDA forward
        and backward run (persistent megakernels or staged kernels, ring size,
        ...). Ignored
        by "cpu" and "xla"; it never changes the result.
      recompute: False (default) keeps the forward's residuals (x's routed
        rows are not kept: the gate/up pre-activations and the schedule, see
        docs/design.md) for the backward; True keeps nothing but the inputs
        and runs the forward again inside the backward (activation
        checkpointing of this layer: less memory, one more forward of
        compute). The gradients are bitwise the same either way.

    Returns:
      ``y[..., H]`` in x's dtype:
      ``sum_k topk_weights[k] * down_e(silu(x gate_e) * (x up_e)) + shared(x)``.

    Raises:
      ValueError / TypeError at trace time for bad shapes, dtypes or options;
      an error naming ``topk_ids`` at run time for ids outside ``[0, E)``.
    """
    megakernel = check_megakernel(megakernel)
    V.check_bool("recompute", recompute)
    x, x2, ids2, w2, mask2, shared, (E, H, F, K, T) = V.flatten_experts_args(
        x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_experts, token_mask)
    Fs = 0 if shared is None else shared[0].shape[1]
    impl = resolve_implementation(implementation, x.dtype, (H, F, Fs, K))
    if T == 0:
        return jnp.zeros(x.shape, x.dtype)
    run = partial(_run, impl, megakernel)
    if recompute:
        # Save nothing inside: the backward re-runs the forward kernel for its
        # residuals (the custom_vjp forward is replayed under the checkpoint).
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
    with jax.named_scope(f"mok_experts_{impl}"):
        return run(x2, ids2, w2, mask2, w_gate, w_up, w_down, shared).reshape(x.shape)


def _run(impl, megakernel, x2, ids2, w2, mask2, w_gate, w_up, w_down, shared):
    if impl == "xla":
        return experts_xla(x2, ids2, w2, mask2, w_gate, w_up, w_down, shared)
    if shared is None:
        in_shard_map = bool(_ffi.varying_axes([x2, ids2, w2, w_gate]))
        shared = empty_shared(x2.shape[1], x2.dtype, in_shard_map)
    wsg, wsu, wsd = shared
    # Inside shard_map: make every input vary like the most-varying one
    # *before* the custom_vjp, so replicated weights get psum'd cotangents.
    inputs, _ = _ffi.reconcile_varying(
        [x2, ids2, w2, mask2.astype(jnp.uint8), w_gate, w_up, w_down, wsg, wsu, wsd])
    return _experts_ffi(impl, megakernel, *inputs)
