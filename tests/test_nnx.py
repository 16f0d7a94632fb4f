"""mok_jax.nnx.MoE: wiring against the float64 NumPy reference, dtypes, logical
axis names, the aux-loss-free bias, and nnx.jit / jax.jit / remat / scan /
optax / orbax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import mok_jax
import mok_jax.nnx as mnnx
import numpy_reference as ref
from helpers import assert_close, fresh_key

H, F, E, K, FS = 16, 24, 6, 2, 8


def _seed():
    return int(jax.random.randint(fresh_key(), (), 0, 2**30))


def _model(**kw):
    args = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K)
    args.update(kw)
    return mnnx.MoE(**args, rngs=nnx.Rngs(_seed()))


def _get(v):
    return v.get_value() if hasattr(v, "get_value") else v.value


def _x(shape=(3, 11), dtype=jnp.float32):
    return jax.random.normal(fresh_key(), (*shape, H), jnp.float32).astype(dtype)


def _numpy_layer(m, x, mask=None, bias=None):
    """float64 NumPy reference of the module's math on its own parameters."""
    p = lambda v: np.asarray(jnp.asarray(_get(v), jnp.float32), np.float64)
    x2 = np.asarray(x, np.float64).reshape(-1, H)
    mask2 = None if mask is None else np.asarray(mask).reshape(-1)
    ids, w, counts, lb, z = ref.route(x2, p(m.router_kernel), K, m.score_func,
                                      m.normalize_topk, bias, m.routed_scaling_factor, mask2)
    shared = None if m.ws_gate is None else (p(m.ws_gate), p(m.ws_up), p(m.ws_down))
    y = ref.experts(x2, ids, w, p(m.w_gate), p(m.w_up), p(m.w_down), shared, mask2)
    return y.reshape(x.shape), counts, lb, z


@pytest.mark.parametrize("impl", ["cpu", "xla"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_forward_and_stored_aux_match_numpy_reference(impl, score_func):
    m = _model(shared_ffn_size=FS, score_func=score_func, routed_scaling_factor=1.5,
               param_dtype=jnp.float32, aux_loss_coeff=0.01, z_loss_coeff=0.001,
               implementation=impl)
    x = _x()
    mask = jax.random.bernoulli(fresh_key(), 0.8, x.shape[:-1])
    y = nnx.jit(lambda m, x, mask: m(x, mask))(m, x, mask)
    want, counts, lb, z = _numpy_layer(m, x, mask)
    assert y.dtype == jnp.float32 and y.shape == x.shape
    assert_close("y", y, want, jnp.float32)
    assert np.all(np.asarray(y)[~np.asarray(mask)] == 0)
    np.testing.assert_array_equal(_get(m.tokens_per_expert), counts)
    np.testing.assert_allclose(_get(m.load_balancing_loss), lb, rtol=1e-5)
    np.testing.assert_allclose(_get(m.router_z_loss), z, rtol=1e-5)
    np.testing.assert_allclose(mnnx.aux_loss(m), 0.01 * lb + 0.001 * z, rtol=1e-5)


def test_defaults_bf16_params_fp32_router_and_return_aux():
    m = _model()
    assert _get(m.w_gate).dtype == jnp.bfloat16 and _get(m.w_down).dtype == jnp.bfloat16
    assert _get(m.router_kernel).dtype == jnp.float32
    assert m.router_bias is None and m.ws_gate is None
    x = _x(dtype=jnp.bfloat16)
    y, aux = m(x, return_aux=True)
    assert y.dtype == jnp.bfloat16 and isinstance(aux, mok_jax.MoEAux)
    want, counts, _, _ = _numpy_layer(m, x)
    assert_close("y", y, want, jnp.bfloat16)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    # float32 activations with bfloat16 params compute in float32 (Flax promotion)
    assert m(x.astype(jnp.float32)).dtype == jnp.float32
    assert _model(dtype=jnp.bfloat16)(x.astype(jnp.float32)).dtype == jnp.bfloat16


def test_logical_axis_names_and_sharding_rules_on_8_devices():
    m = _model(shared_ffn_size=FS, router_bias=True)
    specs = nnx.get_partition_spec(nnx.state(m))
    P = jax.sharding.PartitionSpec
    assert _get(specs["w_gate"]) == P("expert", "embed", "mlp")
    assert _get(specs["w_up"]) == P("expert", "embed", "mlp")
    assert _get(specs["w_down"]) == P("expert", "mlp", "embed")
    assert _get(specs["router_kernel"]) == P("embed", "expert")
    assert _get(specs["router_bias"]) == P("expert")
    assert _get(specs["ws_gate"]) == P("embed", "mlp")

    # A user's rules map the names onto a mesh: experts split over 'data' x 'model'.
    devices = np.array(jax.devices("cpu")[:6]).reshape(2, 3)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    rules = (("expert", "model"), ("embed", None), ("mlp", None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        sharded = mnnx.MoE(H, F, E, K, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    plain = mnnx.MoE(H, F, E, K, param_dtype=jnp.float32, rngs=nnx.Rngs(3))
    assert _get(sharded.w_gate).sharding.spec == P("model", None, None)
    assert _get(sharded.router_kernel).sharding.spec == P(None, "model")
    x = _x()
    y = nnx.jit(lambda m, x: m(x))(sharded, x)
    np.testing.assert_allclose(y, plain(x), rtol=1e-6, atol=1e-6)


def test_router_bias_steers_selection_and_sign_update():
    m = _model(router_bias=True, router_bias_update_rate=0.05, param_dtype=jnp.float32)
    bias = np.asarray(jax.random.normal(fresh_key(), (E,)), np.float32) * 0.3
    mnnx._set(m.router_bias, jnp.asarray(bias))
    x = _x()
    y = m(x)
    want, counts, _, _ = _numpy_layer(m, x, bias=bias)
    assert_close("y", y, want, jnp.float32)
    np.testing.assert_array_equal(_get(m.tokens_per_expert), counts)
    assert mnnx.update_router_biases(m) == 1
    expected = bias + 0.05 * np.sign(counts.mean() - counts)
    np.testing.assert_allclose(_get(m.router_bias), expected, rtol=1e-6)
    # explicit load; [L, E] stacks keep their leading axis
    load = np.asarray(jax.random.randint(fresh_key(), (3, E), 0, 50))
    np.testing.assert_allclose(mnnx.router_bias_update(load, 0.1),
                               0.1 * np.sign(load.mean(-1, keepdims=True) - load))
    with pytest.raises(ValueError, match="router_bias=True"):
        _model().update_router_bias()


def _optimizer(model, tx):
    try:
        return nnx.Optimizer(model, tx, wrt=nnx.Param)
    except TypeError:  # flax < 0.11
        return nnx.Optimizer(model, tx)


def _opt_update(opt, model, grads):
    try:
        opt.update(model, grads)
    except TypeError:  # flax < 0.11
        opt.update(grads)


def test_nnx_jit_optax_step_matches_functional_reference():
    optax = pytest.importorskip("optax")
    m = _model(shared_ffn_size=FS, param_dtype=jnp.float32, aux_loss_coeff=0.1,
               z_loss_coeff=0.01, router_bias=True)
    x, target = _x(), _x()
    lr = 0.05
    names = ["router_kernel", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"]
    p0 = {n: _get(getattr(m, n)) for n in names}
    bias0 = np.asarray(_get(m.router_bias))

    def functional_loss(p):
        y, aux = mok_jax.moe_layer(
            x, p["router_kernel"], p["w_gate"], p["w_up"], p["w_down"], top_k=K,
            shared_experts=(p["ws_gate"], p["ws_up"], p["ws_down"]),
            router_bias=bias0, implementation="xla")
        return (jnp.mean((y - target) ** 2) + 0.1 * aux.load_balancing_loss
                + 0.01 * aux.router_z_loss)

    want_loss, want_grads = jax.jit(jax.value_and_grad(functional_loss))(p0)

    opt = _optimizer(m, optax.sgd(lr))

    @nnx.jit
    def step(m, opt, x, target):
        def loss_fn(m):
            return jnp.mean((m(x) - target) ** 2) + mnnx.aux_loss(m)
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        _opt_update(opt, m, grads)
        return loss, grads

    loss, grads = step(m, opt, x, target)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for name, g in want_grads.items():
        got = _get(getattr(grads, name))
        assert_close(name, got, np.asarray(g, np.float64), jnp.float32)
        np.testing.assert_allclose(_get(getattr(m, name)), p0[name] - lr * got,
                                   rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(_get(m.router_bias), bias0)  # not a Param
    assert int(np.sum(_get(m.tokens_per_expert))) == x.size // H * K  # stats propagated out


def _merge(graphdef, *states):
    """nnx.merge with fresh Variables (flax >= 0.12 reuses the given ones, which
    a module cannot update inside a jax transform they were not created in)."""
    import inspect
    if "copy" in inspect.signature(nnx.merge).parameters:
        return nnx.merge(graphdef, *states, copy=True)
    return nnx.merge(graphdef, *states)


def _remat_problem():
    m = _model(param_dtype=jnp.float32, implementation="cpu")
    return m, _x(), _x()


def test_jax_jit_and_checkpoint_policies_on_split_state():
    from jax.ad_checkpoint import checkpoint_policies as cp
    m, x, probe = _remat_problem()
    graphdef, state, rest = nnx.split(m, nnx.Param, ...)

    def loss(params, rest, x, policy="none"):
        def f(params, rest, x):
            return jnp.sum(_merge(graphdef, params, rest)(x) * probe)
        if policy != "none":
            f = jax.checkpoint(f, policy=policy)
        return f(params, rest, x)

    want = jax.grad(loss)(state, rest, x)
    policies = {"nothing": cp.nothing_saveable,
                "names": cp.save_only_these_names("mok_experts_residual")}
    fwd_calls = {}
    for name, pol in policies.items():
        g = jax.jit(jax.grad(lambda s, r, x: loss(s, r, x, pol)))(state, rest, x)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
            assert_close(name, a, np.asarray(b, np.float64), jnp.float32)
        text = str(jax.make_jaxpr(jax.grad(lambda s, r, x: loss(s, r, x, pol)))(state, rest, x))
        fwd_calls[name] = text.count("mok_experts_fwd_cpu")
    # saving the named residuals avoids recomputing the expert forward
    assert fwd_calls == {"nothing": 2, "names": 1}, fwd_calls


def test_nnx_remat_matches_plain_gradients():
    m, x, probe = _remat_problem()

    def loss_fn(m, remat):
        call = nnx.remat(lambda m, x: m(x)) if remat else (lambda m, x: m(x))
        return jnp.sum(call(m, x) * probe)

    g0 = nnx.grad(lambda m: loss_fn(m, False))(m)
    g1 = nnx.jit(nnx.grad(lambda m: loss_fn(m, True)))(m)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)):
        assert_close("grad", a, np.asarray(b, np.float64), jnp.float32)


def test_nnx_scan_over_a_stack_of_layers_matches_a_loop():
    L = 3
    seed = _seed()

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return mnnx.MoE(H, F, E, K, param_dtype=jnp.float32, aux_loss_coeff=0.1, rngs=rngs)

    stack = create(nnx.Rngs(seed))
    assert _get(stack.w_gate).shape == (L, E, H, F)
    x = _x()

    @nnx.jit
    def run(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return x + layer(x)
        return body(x, stack)

    y = run(stack, x)
    graphdef, state = nnx.split(stack)

    @jax.jit
    def loop(state, x):  # the same layers one after another, unrolled
        loads, aux = [], 0.0
        for i in range(L):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
            x = x + layer(x)
            loads.append(_get(layer.tokens_per_expert))
            aux += mnnx.aux_loss(layer)
        return x, jnp.stack(loads), aux

    want, loads, aux = loop(state, x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(_get(stack.tokens_per_expert), loads)
    np.testing.assert_allclose(mnnx.aux_loss(stack), aux, rtol=1e-5)


def test_orbax_save_restore_gives_identical_outputs(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    kw = dict(shared_ffn_size=FS, router_bias=True)
    m = _model(**kw)
    mnnx._set(m.router_bias, jax.random.normal(fresh_key(), (E,)) * 0.1)
    x = _x(dtype=jnp.bfloat16)
    y = m(x)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "moe", nnx.state(m))
    ckpt.wait_until_finished()

    abstract = nnx.eval_shape(lambda: mnnx.MoE(H, F, E, K, **kw, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    restored = ckpt.restore(tmp_path / "moe", abstract_state)
    m2 = nnx.merge(graphdef, restored)
    np.testing.assert_array_equal(_get(m2.router_bias), _get(m.router_bias))
    np.testing.assert_array_equal(np.asarray(m2(x), np.float32), np.asarray(y, np.float32))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="top_k"):
        _model(top_k=E + 1)
    with pytest.raises(ValueError, match="score_func"):
        _model(score_func="relu")
    with pytest.raises(ValueError, match="implementation"):
        _model(implementation="tpu")
    with pytest.raises(TypeError, match="param_dtype"):
        _model(param_dtype=jnp.int32)
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        _model(aux_loss_coeff=-1.0)
    with pytest.raises(TypeError, match="ffn_size"):
        _model(ffn_size=2.5)
    m = _model()
    with pytest.raises(ValueError, match="hidden_size=16"):
        m(jnp.ones((4, H + 1), jnp.bfloat16))
    with pytest.raises(ValueError, match="token_mask"):
        m(jnp.ones((4, H), jnp.bfloat16), jnp.ones((5,), bool))
