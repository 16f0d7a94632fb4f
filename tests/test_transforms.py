"""jit, vmap, grad and shard_map (8 CPU devices) all match the reference."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from helpers import assert_close, make_problem


def _loss(impl, K=2):
    def f(x, router, wg, wu, wd):
        y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, implementation=impl)
        return jnp.sum(y * jnp.cos(y)) + aux.load_balancing_loss
    return f


def test_vmap_over_a_leading_axis():
    B, T, H, F, E = 3, 40, 16, 24, 6
    x, router, wg, wu, wd, _ = make_problem(None, H, F, E, lead=(B, T))
    for impl in ("cpu", "xla"):
        layer = lambda x: mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2,
                                            implementation=impl)[0]
        batched = jax.jit(jax.vmap(layer))(x)
        looped = jnp.stack([layer(x[b]) for b in range(B)])
        np.testing.assert_allclose(batched, looped, rtol=1e-6, atol=1e-6)
        g_b = jax.grad(lambda x: jnp.sum(jax.vmap(layer)(x) ** 2))(x)
        g_l = jax.grad(lambda x: jnp.sum(layer(x.reshape(B * T, H)) ** 2))(x)
        np.testing.assert_allclose(g_b, g_l, rtol=1e-5, atol=1e-5)


def test_vmap_over_batched_weights():
    x, router, wg, wu, wd, _ = make_problem(30, 8, 12, 4)
    wgs = jnp.stack([wg, 2 * wg])
    f = lambda w: mok_jax.moe_layer(x, router, w, wu, wd, top_k=2, implementation="cpu")[0]
    np.testing.assert_allclose(jax.vmap(f)(wgs)[1], f(2 * wg), rtol=1e-6, atol=1e-6)


def test_shard_map_data_parallel_tokens_on_8_devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "conftest.py asks XLA for 8 CPU devices"
    mesh = Mesh(np.array(devices[:8]), ("data",))
    T, H, F, E = 8 * 37, 16, 24, 8
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E)

    def sharded(impl):
        def per_shard(x, router, wg, wu, wd):
            y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation=impl)
            return y, jax.lax.psum(aux.tokens_per_expert, "data")
        return jax.jit(jax.shard_map(per_shard, mesh=mesh,
                                     in_specs=(P("data"), P(), P(), P(), P()),
                                     out_specs=(P("data"), P())))

    y_ref, aux_ref = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation="xla")
    for impl in ("cpu", "xla"):
        y, counts = sharded(impl)(x, router, wg, wu, wd)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(counts, aux_ref.tokens_per_expert)

    # Gradients w.r.t. replicated weights are psum'd over the token shards.
    def sharded_loss(impl):
        def per_shard(x, router, wg, wu, wd):
            y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation=impl)
            return jax.lax.psum(jnp.sum(y * jnp.cos(y)), "data")
        f = jax.shard_map(per_shard, mesh=mesh, in_specs=(P("data"), P(), P(), P(), P()),
                          out_specs=P())
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(x, router, wg, wu, wd)

    def plain(x, router, wg, wu, wd):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation="xla")
        return jnp.sum(y * jnp.cos(y))
    want = jax.grad(plain, argnums=(0, 1, 2, 3, 4))(x, router, wg, wu, wd)
    got = sharded_loss("cpu")
    for g, w in zip(got, want):
        assert_close("grad", g, np.asarray(w, np.float64), jnp.float32)


def test_grad_under_jit_matches_reference():
    x, router, wg, wu, wd, _ = make_problem(77, 16, 20, 5)
    got = jax.jit(jax.grad(_loss("cpu"), argnums=(0, 1, 2, 3, 4)))(x, router, wg, wu, wd)
    want = jax.grad(_loss("xla"), argnums=(0, 1, 2, 3, 4))(x, router, wg, wu, wd)
    for g, w in zip(got, want):
        assert_close("grad", g, np.asarray(w, np.float64), jnp.float32)


def test_checkpoint_around_the_layer():
    x, router, wg, wu, wd, _ = make_problem(50, 8, 12, 4)
    f = _loss("cpu")
    got = jax.grad(jax.checkpoint(f), argnums=(0, 2))(x, router, wg, wu, wd)
    want = jax.grad(f, argnums=(0, 2))(x, router, wg, wu, wd)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_named_scopes_label_the_stages_in_profiles():
    """Profiles show the router and the stages: jax.named_scope names reach the
    HLO op metadata (what the profiler shows)."""
    x, router, wg, wu, wd, _ = make_problem(40, 8, 12, 4)
    names = {"xla": ("mok_route", "mok_experts_xla", "mok_schedule", "mok_dispatch",
                     "mok_expert_ffn", "mok_combine"),
             "cpu": ("mok_route", "mok_experts_cpu")}
    for impl, want in names.items():
        f = lambda x: mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation=impl)[0]
        text = jax.jit(f).lower(x).as_text(debug_info=True)
        for name in want:
            assert name in text, (impl, name)
