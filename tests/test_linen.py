"""mok_jax.linen.MoE: wiring against the float64 NumPy reference, sown losses,
the router-bias collection, partitioning metadata, jit / remat / scan / optax /
orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")

import mok_jax.linen as mlinen
import numpy_reference as ref
from helpers import assert_close, fresh_key

H, F, E, K, FS = 16, 24, 6, 2, 8


def _x(shape=(3, 11), dtype=jnp.float32):
    return jax.random.normal(fresh_key(), (*shape, H), jnp.float32).astype(dtype)


def _np(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _reference(params, x, mask=None, bias=None, score_func="softmax", scale=1.0):
    p = {k: _np(v) for k, v in nn.unbox(params).items()}
    x2 = np.asarray(x, np.float64).reshape(-1, H)
    m2 = None if mask is None else np.asarray(mask).reshape(-1)
    ids, w, counts, lb, z = ref.route(x2, p["router_kernel"], K, score_func, True, bias,
                                      scale, m2)
    shared = (p["ws_gate"], p["ws_up"], p["ws_down"]) if "ws_gate" in p else None
    y = ref.experts(x2, ids, w, p["w_gate"], p["w_up"], p["w_down"], shared, m2)
    return y.reshape(x.shape), counts, lb, z


def test_forward_sown_values_and_bias_update_match_numpy_reference():
    layer = mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, hidden_size=H, shared_ffn_size=FS,
                       score_func="sigmoid", routed_scaling_factor=2.0,
                       param_dtype=jnp.float32, router_bias=True, router_bias_update_rate=0.01,
                       aux_loss_coeff=0.01, z_loss_coeff=0.001, implementation="cpu")
    x = _x()
    mask = jax.random.bernoulli(fresh_key(), 0.8, x.shape[:-1])
    variables = layer.init(jax.random.key(1), x, mask)
    bias = np.asarray(jax.random.normal(fresh_key(), (E,)) * 0.2, np.float32)
    variables = {**variables, "moe_bias": {"router_bias": variables["moe_bias"]["router_bias"]
                                           .replace_boxed(jnp.asarray(bias))}}
    y, state = jax.jit(lambda v, x, m: layer.apply(v, x, m, mutable=["intermediates"]))(
        variables, x, mask)
    want, counts, lb, z = _reference(variables["params"], x, mask, bias, "sigmoid", 2.0)
    assert_close("y", y, want, jnp.float32)
    inter = state["intermediates"]
    np.testing.assert_array_equal(inter["tokens_per_expert"][0], counts)
    np.testing.assert_allclose(inter["load_balancing_loss"][0], lb, rtol=1e-5)
    np.testing.assert_allclose(inter["router_z_loss"][0], z, rtol=1e-5)
    np.testing.assert_allclose(mlinen.aux_loss(inter), 0.01 * lb + 0.001 * z, rtol=1e-5)
    new = mlinen.apply_router_bias_updates(variables["moe_bias"], inter)
    np.testing.assert_allclose(nn.unbox(new)["router_bias"],
                               bias + 0.01 * np.sign(counts.mean() - counts), rtol=1e-6)
    with pytest.raises(ValueError, match="router_bias_update"):
        mlinen.apply_router_bias_updates(variables["moe_bias"], {})


def test_defaults_partitioning_metadata_and_errors():
    layer = mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, router_bias=True)
    x = _x(dtype=jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    p = nn.unbox(variables["params"])
    assert p["w_gate"].dtype == jnp.bfloat16 and p["router_kernel"].dtype == jnp.float32
    P = jax.sharding.PartitionSpec
    spec = nn.get_partition_spec(variables)
    assert spec["params"]["w_gate"] == P("expert", "embed", "mlp")
    assert spec["params"]["w_up"] == P("expert", "embed", "mlp")
    assert spec["params"]["w_down"] == P("expert", "mlp", "embed")
    assert spec["params"]["router_kernel"] == P("embed", "expert")
    assert spec["moe_bias"]["router_bias"] == P("expert")
    rules = (("expert", "model"), ("embed", None), ("mlp", None))
    mesh_spec = nn.logical_to_mesh(spec, rules)
    assert mesh_spec["params"]["w_down"] == P("model", None, None)
    y = layer.apply(variables, x)
    assert y.dtype == jnp.bfloat16
    assert_close("y", y, _reference(variables["params"], x)[0], jnp.bfloat16)
    with pytest.raises(ValueError, match="top_k"):
        mlinen.MoE(num_experts=E, top_k=E + 1, ffn_size=F).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="hidden_size"):
        mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, hidden_size=H + 1).init(
            jax.random.key(0), x)


class _Stack(nn.Module):
    """Layers of x + MoE(x), as nn.scan over nn.remat."""
    layers: int
    remat: bool = True

    @nn.compact
    def __call__(self, x):
        block = nn.remat(_Residual) if self.remat else _Residual
        scanned = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                          split_rngs={"params": True}, length=self.layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = scanned(name="layers")(x, None)
        return x


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, param_dtype=jnp.float32,
                              aux_loss_coeff=0.1, implementation="cpu")(x), None


def test_scan_remat_jit_and_optax_step_match_an_unrolled_reference():
    optax = pytest.importorskip("optax")
    L = 3
    model = _Stack(L)
    x, target = _x(), _x()
    variables = model.init(jax.random.key(2), x)
    params = variables["params"]
    assert nn.unbox(params)["layers"]["MoE_0"]["w_gate"].shape == (L, E, H, F)

    def loss(params):
        y, state = model.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.mean((y - target) ** 2) + mlinen.aux_loss(state["intermediates"])

    def unrolled_loss(params):  # the same layers applied one by one, no scan/remat
        p = nn.unbox(params)["layers"]["MoE_0"]
        y, aux = x, 0.0
        for i in range(L):
            layer = mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, param_dtype=jnp.float32,
                               aux_loss_coeff=0.1, implementation="xla")
            out, st = layer.apply({"params": jax.tree.map(lambda a: a[i], p)}, y,
                                  mutable=["intermediates"])
            y, aux = y + out, aux + mlinen.aux_loss(st["intermediates"])
        return jnp.mean((y - target) ** 2) + aux

    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, l, g

    new_params, _, l, g = step(params, opt_state)
    want_l, want_g = jax.jit(jax.value_and_grad(unrolled_loss))(params)
    np.testing.assert_allclose(l, want_l, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(nn.unbox(g)), jax.tree_util.tree_leaves(
            nn.unbox(want_g))):
        assert_close("grad", a, _np(b), jnp.float32)
    # the first Adam step moves every weight with a non-zero gradient by ~lr
    delta = jax.tree.map(lambda a, b: jnp.abs(a - b), nn.unbox(new_params), nn.unbox(params))
    for d, gr in zip(jax.tree_util.tree_leaves(delta), jax.tree_util.tree_leaves(nn.unbox(g))):
        moved = np.asarray(d)[np.abs(np.asarray(gr)) > 1e-6]
        np.testing.assert_allclose(moved, 1e-2, rtol=1e-2)


def test_orbax_save_restore_gives_identical_outputs(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    layer = mlinen.MoE(num_experts=E, top_k=K, ffn_size=F, shared_ffn_size=FS, router_bias=True)
    x = _x(dtype=jnp.bfloat16)
    variables = nn.unbox(layer.init(jax.random.key(4), x))
    variables["moe_bias"]["router_bias"] = jax.random.normal(fresh_key(), (E,)) * 0.1
    y = layer.apply(variables, x)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "moe", variables)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), variables)
    restored = ckpt.restore(tmp_path / "moe", abstract)
    np.testing.assert_array_equal(_np(layer.apply(restored, x)), _np(y))
