"""Token masks, extreme imbalance, determinism and non-finite inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
import numpy_reference as npref
from helpers import assert_close, fresh_key, make_problem

IMPLS = ["cpu", "xla"]


@pytest.mark.parametrize("impl", IMPLS)
def test_token_mask_zeroes_output_and_aux(impl):
    T, H, F, E, K = 90, 16, 24, 8, 2
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, shared_ffn=8)
    mask = jax.random.bernoulli(fresh_key(), 0.6, (T,))
    y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=shared,
                               token_mask=mask, implementation=impl)
    m = np.asarray(mask)
    assert np.all(np.asarray(y)[~m] == 0.0)
    # Aux values equal those of the unmasked tokens alone.
    y_live, aux_live = mok_jax.moe_layer(x[m], router, wg, wu, wd, top_k=K,
                                         shared_experts=shared, implementation=impl)
    np.testing.assert_array_equal(aux.tokens_per_expert, aux_live.tokens_per_expert)
    np.testing.assert_allclose(aux.load_balancing_loss, aux_live.load_balancing_loss, rtol=1e-6)
    np.testing.assert_allclose(aux.router_z_loss, aux_live.router_z_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y)[m], y_live, rtol=1e-6, atol=1e-6)
    # ...and masked tokens get exact zero gradients.
    dx = jax.grad(lambda x: jnp.sum(mok_jax.moe_layer(
        x, router, wg, wu, wd, top_k=K, shared_experts=shared, token_mask=mask,
        implementation=impl)[0] ** 2))(x)
    assert np.all(np.asarray(dx)[~m] == 0.0)


def test_masked_tokens_are_not_dispatched():
    """With every token masked, nothing is routed: the schedule is empty."""
    T, H, F, E = 40, 8, 8, 4
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    ids = jnp.zeros((T, 2), jnp.int32)
    w = jnp.ones((T, 2))
    from mok_jax import _ffi
    inputs = [x, ids, w, jnp.zeros((T,), jnp.uint8), wg, wu, wd,
              jnp.zeros((H, 0)), jnp.zeros((H, 0)), jnp.zeros((0, H))]
    y, offsets, row_pair, pair_row, *_ = _ffi.forward_call("cpu", inputs)
    assert np.all(np.asarray(offsets) == 0)
    assert np.all(np.asarray(row_pair) == -1) and np.all(np.asarray(pair_row) == -1)
    assert np.all(np.asarray(y) == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_tokens_to_one_expert_and_empty_experts(impl):
    T, H, F, E, K = 300, 16, 24, 8, 1
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    ids = jnp.full((T, K), 3, jnp.int32)
    w = jax.random.uniform(fresh_key(), (T, K))
    y = mok_jax.experts(x, ids, w, wg, wu, wd, implementation=impl)
    assert_close("y", y, npref.experts(x, np.asarray(ids), np.asarray(w), wg, wu, wd),
                 jnp.float32)
    grads = jax.grad(lambda wg, wu, wd: jnp.sum(mok_jax.experts(
        x, ids, w, wg, wu, wd, implementation=impl) ** 2), argnums=(0, 1, 2))(wg, wu, wd)
    for g in grads:
        g = np.asarray(g)
        assert np.all(g[np.arange(E) != 3] == 0.0), "experts with no tokens get exact zeros"
        assert np.linalg.norm(g[3]) > 0


def test_schedule_layout_is_padded_and_ordered():
    T, K, E = 50, 3, 5
    x, _, wg, wu, wd, _ = make_problem(T, 8, 8, E)
    ids = jax.random.randint(fresh_key(), (T, K), 0, E - 1)  # expert E-1 stays empty
    from mok_jax import _ffi
    inputs = [x, ids, jnp.ones((T, K)), jnp.ones((T,), jnp.uint8), wg, wu, wd,
              jnp.zeros((8, 0)), jnp.zeros((8, 0)), jnp.zeros((0, 8))]
    _, offsets, row_pair, pair_row, *_ = (np.asarray(a) for a in
                                          _ffi.forward_call("cpu", inputs))
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    tile = _ffi.TILE_ROWS
    np.testing.assert_array_equal(np.diff(offsets), -(-counts // tile) * tile)
    for e in range(E):
        seg = row_pair[offsets[e]:offsets[e + 1]]
        real = seg[:counts[e]]
        np.testing.assert_array_equal(real, np.nonzero(np.asarray(ids).ravel() == e)[0])
        assert np.all(seg[counts[e]:] == -1)
    assert np.all(row_pair[offsets[E]:] == -1)
    np.testing.assert_array_equal(row_pair[pair_row], np.arange(T * K))


def test_bitwise_determinism():
    x, router, wg, wu, wd, shared = make_problem(500, 24, 40, 16, jnp.bfloat16, 8)

    def run():
        f = lambda *a: mok_jax.moe_layer(*a, top_k=4, shared_experts=shared,
                                         implementation="cpu")[0].astype(jnp.float32).sum()
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))(x, router, wg, wu, wd)

    a, b = run(), run()
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_rows_stay_in_their_rows(impl):
    T, H = 64, 16
    x, _, wg, wu, wd, shared = make_problem(T, H, 24, 8, shared_ffn=8)
    x = x.at[5, 3].set(jnp.nan).at[17, 0].set(jnp.inf)
    ids = jax.random.randint(fresh_key(), (T, 2), 0, 8)
    y = mok_jax.experts(x, ids, jnp.full((T, 2), 0.5), wg, wu, wd, shared_experts=shared,
                        implementation=impl)
    finite = np.all(np.isfinite(np.asarray(y)), axis=1)
    assert not finite[5] and not finite[17]
    assert finite.sum() == T - 2
