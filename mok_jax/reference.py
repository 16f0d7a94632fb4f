"""The pure-JAX ("xla") experts: dropless, differentiable by JAX, the oracle
the FFI backends are tested against. It follows the same precision contract:
fp32 accumulation, the SwiGLU activation stored in x's dtype before the down
projection, fp32 combine in fixed k order, output in x's dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _ffn(rows, w_gate, w_up, w_down, group_sizes):
    """SwiGLU FFN of expert-sorted rows through jax.lax.ragged_dot."""
    hp = jax.lax.Precision.HIGHEST
    f32 = jnp.float32
    if group_sizes is None:  # one dense expert (the shared expert)
        g = jnp.dot(rows, w_gate, precision=hp, preferred_element_type=f32)
        u = jnp.dot(rows, w_up, precision=hp, preferred_element_type=f32)
        a = (jax.nn.silu(g) * u).astype(rows.dtype)
        return jnp.dot(a, w_down, precision=hp, preferred_element_type=f32)
    g = jax.lax.ragged_dot(rows, w_gate, group_sizes, precision=hp, preferred_element_type=f32)
    u = jax.lax.ragged_dot(rows, w_up, group_sizes, precision=hp, preferred_element_type=f32)
    a = (jax.nn.silu(g) * u).astype(rows.dtype)
    return jax.lax.ragged_dot(a, w_down, group_sizes, precision=hp, preferred_element_type=f32)


def _experts_math(x, topk_ids, topk_weights, token_mask, w_gate, w_up, w_down, shared):
    """x[T,H], topk_ids[T,K], topk_weights[T,K] f32, token_mask[T] bool."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E = w_gate.shape[0]
    valid = jnp.repeat(token_mask, K)
    # Masked pairs ride along in the last expert with zero rows (silu(0)*0 = 0)
    # and are excluded again in the combine.
    key = jnp.where(valid, topk_ids.reshape(-1), E - 1).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=E).astype(jnp.int32)
    rows = jnp.where(valid[order][:, None], x[order // K], jnp.zeros((), x.dtype))
    out_sorted = _ffn(rows, w_gate, w_up, w_down, group_sizes)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(T, K, H)
    w = jnp.where(token_mask[:, None], topk_weights.astype(jnp.float32), 0.0)
    y = jnp.zeros((T, H), jnp.float32)
    if shared is not None:  # the kernels' accumulator starts from the shared expert
        xs = jnp.where(token_mask[:, None], x, jnp.zeros((), x.dtype))
        y = jnp.where(token_mask[:, None], _ffn(xs, *shared, None), 0.0)
    for k in range(K):  # then adds k = 0..K-1 in order
        y = y + jnp.where(token_mask[:, None], w[:, k:k + 1] * out[:, k], 0.0)
    return y.astype(x.dtype)


# jax.lax.ragged_dot has no batching rule for batched group sizes, so under
# vmap the reference runs one batch element at a time (sequential_vmap); its
# gradient is JAX's own VJP of the same math, also applied per element.
_forward_seq = jax.custom_batching.sequential_vmap(_experts_math)


@jax.custom_batching.sequential_vmap
def _backward_seq(dy, x, topk_ids, topk_weights, token_mask, w_gate, w_up, w_down, shared):
    f = lambda x, w, wg, wu, wd, sh: _experts_math(x, topk_ids, w, token_mask, wg, wu, wd, sh)
    return jax.vjp(f, x, topk_weights, w_gate, w_up, w_down, shared)[1](dy)


@jax.custom_vjp
def experts_xla(x, topk_ids, topk_weights, token_mask, w_gate, w_up, w_down, shared):
    return _forward_seq(x, topk_ids, topk_weights, token_mask, w_gate, w_up, w_down, shared)


def _fwd(*args):
    return experts_xla(*args), args


def _bwd(args, dy):
    dx, dw, dwg, dwu, dwd, dsh = _backward_seq(dy, *args)
    return dx, None, dw, None, dwg, dwu, dwd, dsh


experts_xla.defvjp(_fwd, _bwd)
