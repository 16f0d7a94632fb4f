"""Backward: the CPU FFI backward (bound by custom_vjp) against the float64
NumPy reference's hand-derived gradients, and the full layer's gradients
(router included) against JAX's autodiff of the XLA reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
import numpy_reference as npref
from helpers import assert_close, fresh_key, make_problem
from test_forward import CASES, IDS


def _expert_grads(impl, x, ids, w, wg, wu, wd, shared, dy, mask=None):
    def f(x, w, wg, wu, wd, shared):
        return mok_jax.experts(x, ids, w, wg, wu, wd, shared_experts=shared, token_mask=mask,
                               implementation=impl)
    _, vjp = jax.vjp(jax.jit(f), x, w, wg, wu, wd, shared)
    return vjp(dy)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_expert_gradients_match_float64_reference(case):
    T, H, F, E, K, score, _, Fs, dtype = case
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, dtype, Fs)
    aux = mok_jax.route(x, router, top_k=K, score_func=score)
    ids, w = aux.topk_ids, aux.topk_weights
    dy = jax.random.normal(fresh_key(), x.shape, jnp.float32).astype(dtype)
    want = npref.experts_grads(x, np.asarray(ids), np.asarray(w), wg, wu, wd, dy, shared)
    names = ["d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]
    for impl in ("cpu", "xla"):
        got = _expert_grads(impl, x, ids, w, wg, wu, wd, shared, dy)
        for name, g, r in zip(names, got[:5], want[:5]):
            assert g.dtype == (jnp.float32 if name == "d_topk_weights" else dtype), name
            assert_close(f"{name} ({impl})", g, r, dtype)
        if shared is not None:
            for i, (g, r) in enumerate(zip(got[5], want[5])):
                assert_close(f"d_shared[{i}] ({impl})", g, r, dtype)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_gradients_cpu_match_xla(score, dtype):
    x, router, wg, wu, wd, shared = make_problem(211, 24, 32, 12, dtype, 16)
    probe = jax.random.normal(fresh_key(), x.shape, jnp.float32)

    def loss(impl):
        def f(x, router, wg, wu, wd, shared):
            y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=3, score_func=score,
                                       shared_experts=shared, implementation=impl)
            return (jnp.sum(y.astype(jnp.float32) * probe) + 0.1 * aux.load_balancing_loss
                    + 0.01 * aux.router_z_loss)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4, 5)))(x, router, wg, wu, wd, shared)

    got, want = jax.tree.leaves(loss("cpu")), jax.tree.leaves(loss("xla"))
    for i, (g, r) in enumerate(zip(got, want)):
        assert_close(f"grad[{i}]", g, np.asarray(r.astype(jnp.float32), np.float64), dtype)
