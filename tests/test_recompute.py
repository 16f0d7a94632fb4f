"""recompute=True (activation checkpointing of the experts): bitwise the same
gradients as keeping the residuals, the forward kernel runs twice in the
gradient, and the forward keeps (almost) nothing but the layer's inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from benchmarks.common import jax_residual_bytes
from helpers import make_problem


def _loss(impl, recompute, K=2, shared=None):
    def f(x, router, wg, wu, wd):
        y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, implementation=impl,
                                   shared_experts=shared, recompute=recompute)
        return jnp.sum(y * jnp.cos(y)) + aux.load_balancing_loss
    return f


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_recompute_gives_bitwise_the_same_gradients(impl):
    T, H, F, E, K, Fs = 96, 16, 24, 8, 2, 8
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=Fs)
    args = (x, router, wg, wu, wd)
    g0 = jax.jit(jax.value_and_grad(_loss(impl, False, K, sh), argnums=range(5)))(*args)
    g1 = jax.jit(jax.value_and_grad(_loss(impl, True, K, sh), argnums=range(5)))(*args)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_array_equal(a, b)


def test_recompute_runs_the_forward_kernel_again_and_keeps_less():
    T, H, F, E, K = 128, 16, 64, 8, 2
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E)
    args = (x, router, wg, wu, wd)
    counts = {}
    for recompute in (False, True):
        jaxpr = str(jax.make_jaxpr(jax.grad(_loss("cpu", recompute, K), argnums=(0, 2)))(*args))
        counts[recompute] = jaxpr.count("mok_experts_fwd_cpu")
    assert counts[False] == 1 and counts[True] == 2, counts
    kept = {r: jax_residual_bytes(_loss("cpu", r, K), args) for r in (False, True)}
    # Kept without recompute: at least the gate/up pre-activations, 2*T*K*F floats.
    assert kept[False] >= 2 * T * K * F * 4, kept
    # With recompute: only the router's values (logits, softmax, top-k; measured
    # 35 KB here against 697 KB).
    assert kept[True] * 10 < kept[False], kept


def test_recompute_under_nnx_module_and_bad_value():
    from flax import nnx
    m = mok_jax.nnx.MoE(hidden_size=16, ffn_size=24, num_experts=4, top_k=2,
                        implementation="cpu", recompute=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 20, 16))
    g = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)
    assert np.all(np.isfinite(np.asarray(g.w_gate[...])))
    with pytest.raises(TypeError, match="recompute"):
        mok_jax.moe_layer(x, jnp.zeros((16, 4)), m.w_gate[...], m.w_up[...], m.w_down[...],
                          top_k=2, recompute="yes")
