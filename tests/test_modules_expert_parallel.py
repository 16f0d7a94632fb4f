"""The Flax modules (mok_jax.nnx.MoE, mok_jax.linen.MoE) with mesh= on 4 CPU
devices: the same output and gradients as the one-device module, for the
collective and the peer dispatch (the layer-level guarantees are those of
test_expert_parallel.py and test_peer_dispatch.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")

import mok_jax.linen as mlinen
import mok_jax.nnx as mnnx
from helpers import fresh_key

H, F, E, K, FS = 16, 24, 8, 2, 8
TOL = 1e-5


def _mesh():
    return Mesh(np.array(jax.devices()[:4]), ("expert",))


def _close(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= TOL, f"{name}: relative max error {err:.3g}"


@pytest.mark.parametrize("dispatch", ["collective", "peer"])
def test_nnx_module_with_a_mesh(dispatch):
    seed = int(jax.random.randint(fresh_key(), (), 0, 2**30))
    kw = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K, shared_ffn_size=FS,
              param_dtype=jnp.float32)
    one = mnnx.MoE(**kw, rngs=nnx.Rngs(seed))
    ep = mnnx.MoE(**kw, mesh=_mesh(), expert_axis="expert", dispatch=dispatch,
                  rngs=nnx.Rngs(seed))
    x = jax.random.normal(fresh_key(), (4, 16, H))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
    l0, g0 = step(one, x)
    l1, g1 = step(ep, x)
    _close("loss", l1, l0)
    _close("dx", g1[1], g0[1])
    for name in ("w_gate", "w_up", "w_down", "router_kernel", "ws_gate"):
        _close(name, getattr(g1[0], name).get_value(), getattr(g0[0], name).get_value())
    np.testing.assert_array_equal(np.asarray(ep.tokens_per_expert.get_value()),
                                  np.asarray(one.tokens_per_expert.get_value()))


@pytest.mark.parametrize("dispatch", ["collective", "peer"])
def test_linen_module_with_a_mesh(dispatch):
    x = jax.random.normal(fresh_key(), (4, 16, H))
    kw = dict(num_experts=E, top_k=K, ffn_size=F, shared_ffn_size=FS, param_dtype=jnp.float32)
    one = mlinen.MoE(**kw)
    ep = mlinen.MoE(**kw, mesh=_mesh(), expert_axis="expert", dispatch=dispatch)
    variables = one.init(jax.random.key(1), x)

    def loss(module, params, x):
        return jnp.sum(module.apply({"params": params}, x) ** 2)

    grads = lambda m: jax.jit(jax.grad(lambda p, x: loss(m, p, x), argnums=(0, 1)))(
        variables["params"], x)
    g0, g1 = grads(one), grads(ep)
    _close("dx", g1[1], g0[1])
    for a, b in zip(jax.tree.leaves(g1[0]), jax.tree.leaves(g0[0])):
        _close("param grad", a, b)
    _close("y", ep.apply(variables, x), one.apply(variables, x))
