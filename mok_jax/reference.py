"""The pure-JAX ("xla") experts: dropless, differentiable by JAX, the oracle
the FFI backends are tested against. It follows the same precision contract:
fp32 accumulation, the SwiGLU activation stored in x's dtype before the down
projection, fp32 combine in fixed k order (shared expert first), output in
x's dtype.

It uses the kernels' layout: expert segments padded to 128-row tiles, and a
loop over groups of tiles, each a small dense matmul against its expert's
weights. (`jax.lax.ragged_dot` would be the natural op, but on GPUs it lowers
to a dense [rows, E, ...] expansion that runs out of memory at real MoE
shapes, forward and backward.) Plain JAX ops throughout, so `grad` and
`vmap` work as usual.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 128        # rows per tile (plan.h kTileRows)
TILES_PER_STEP = 8  # tiles per loop step: bounds the gathered weights to 8 experts


def _tile_matmul(tiles, w, tile_expert):
    """tiles [n, TILE, K] @ w[tile_expert] ([E, K, N]) -> [n, TILE, N] in fp32."""
    def one(args):
        xt, e = args
        return jnp.dot(xt, w[e], precision=jax.lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    return jax.lax.map(one, (tiles, tile_expert), batch_size=TILES_PER_STEP)


def _swiglu_ffn(rows, w_gate, w_up, w_down, matmul):
    g = matmul(rows, w_gate)
    u = matmul(rows, w_up)
    a = (jax.nn.silu(g) * u).astype(rows.dtype)
    return matmul(a, w_down)


def _padded_layout(key, E, R):
    """Row of each pair in the expert-major layout padded to TILE rows, and the
    expert of each tile (tiles past the last segment get expert 0, zero rows)."""
    counts = jnp.bincount(key, length=E)
    padded = (counts + TILE - 1) // TILE * TILE
    start = jnp.cumsum(padded) - padded
    order = jnp.argsort(key, stable=True)
    rank = jnp.zeros_like(key).at[order].set(jnp.arange(key.shape[0], dtype=key.dtype))
    first = jnp.cumsum(counts) - counts  # rank of each expert's first pair
    row = start[key] + rank - first[key]
    tile_start = jnp.arange(R // TILE, dtype=jnp.int32) * TILE
    tile_expert = jnp.clip(jnp.searchsorted(start + padded, tile_start, side="right"), 0, E - 1)
    return row, tile_expert


def experts_xla(x, topk_ids, topk_weights, token_mask, w_gate, w_up, w_down, shared):
    """x[T,H], topk_ids[T,K], topk_weights[T,K] f32, token_mask[T] bool."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E = w_gate.shape[0]
    R = -(-(T * K + E * (TILE - 1)) // TILE) * TILE
    valid = jnp.repeat(token_mask, K)
    # Masked pairs ride along in the last expert with zero rows (silu(0)*0 = 0)
    # and are excluded again in the combine.
    # Named scopes per stage, so profiles of this path read like the kernels'
    # stages (the FFI paths are one fused op under mok_experts_<impl>).
    with jax.named_scope("mok_schedule"):
        key = jnp.where(valid, topk_ids.reshape(-1), E - 1).astype(jnp.int32)
        row, tile_expert = _padded_layout(key, E, R)
    with jax.named_scope("mok_dispatch"):
        src = jnp.where(valid[:, None], jnp.repeat(x, K, axis=0), jnp.zeros((), x.dtype))
        rows = jnp.zeros((R, H), x.dtype).at[row].set(src, unique_indices=True)

    def grouped(r, w):
        n = r.shape[-1]
        return _tile_matmul(r.reshape(-1, TILE, n), w, tile_expert).reshape(R, -1)

    with jax.named_scope("mok_expert_ffn"):
        out = _swiglu_ffn(rows, w_gate, w_up, w_down, grouped)
    with jax.named_scope("mok_combine"):
        out = out[row].reshape(T, K, H)
        w = jnp.where(token_mask[:, None], topk_weights.astype(jnp.float32), 0.0)
        y = jnp.zeros((T, H), jnp.float32)
        if shared is not None:  # the CPU kernel's accumulator starts from the shared expert
            xs = jnp.where(token_mask[:, None], x, jnp.zeros((), x.dtype))
            dense = lambda r, w: jnp.dot(r, w, precision=jax.lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)
            y = jnp.where(token_mask[:, None], _swiglu_ffn(xs, *shared, dense), 0.0)
        for k in range(K):  # then adds k = 0..K-1 in order
            y = y + jnp.where(token_mask[:, None], w[:, k:k + 1] * out[:, k], 0.0)
        return y.astype(x.dtype)
