"""mok_jax.convert: exact round trips on fresh random tensors, and the converted
weights compute what the source framework computes (its own formula in NumPy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import convert
from helpers import assert_close, fresh_key

E, H, F, FS, K = 5, 12, 20, 8, 2


def _rand(*shape):
    return np.asarray(jax.random.normal(fresh_key(), shape), np.float32)


def _silu(v):
    return v / (1 + np.exp(-v))


def _hf_expert(x, gate, up, down):
    """What an HF expert MLP computes: down_proj(act(gate_proj(x)) * up_proj(x)) with
    nn.Linear weights [out, in]."""
    x = np.asarray(x, np.float64)
    return (_silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe_y(ids, w, per_expert):
    T = ids.shape[0]
    return np.stack([sum(w[t, k] * per_expert(ids[t, k], t) for k in range(ids.shape[1]))
                     for t in range(T)])


def _route(x, router):
    aux = mok_jax.route(jnp.asarray(x), jnp.asarray(router), top_k=K)
    return np.asarray(aux.topk_ids), np.asarray(aux.topk_weights, np.float64)


@pytest.mark.parametrize("style", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_hf_state_dict_round_trip_and_semantics(style):
    s = convert.HF_STYLES[style]
    pre = "model.layers.7." + s["block"]
    sd = {pre + s["router"]: _rand(E, H)}
    for e in range(E):
        p = pre + s["experts"].format(e=e)
        sd[p + s["gate"]], sd[p + s["up"]], sd[p + s["down"]] = _rand(F, H), _rand(F, H), _rand(H, F)
    if s.get("bias"):
        sd[pre + s["bias"]] = _rand(E)
    if s.get("shared"):
        sp = pre + s["shared"]
        sd[sp + "gate_proj.weight"], sd[sp + "up_proj.weight"] = _rand(FS, H), _rand(FS, H)
        sd[sp + "down_proj.weight"] = _rand(H, FS)
    params = convert.from_hf_state_dict(sd, layer_prefix="model.layers.7.", num_experts=E,
                                        style=style)
    assert params["w_gate"].shape == (E, H, F) and params["w_down"].shape == (E, F, H)
    assert params["router_kernel"].shape == (H, E)
    back = convert.to_hf_state_dict(params, layer_prefix="model.layers.7.", style=style)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)

    # The converted layer computes the HF formula on the same routing.
    x = _rand(9, H)
    shared = None
    if "ws_gate" in params:
        shared = tuple(jnp.asarray(params[n]) for n in ("ws_gate", "ws_up", "ws_down"))
    y, aux = mok_jax.moe_layer(jnp.asarray(x), jnp.asarray(params["router_kernel"]),
                               *(jnp.asarray(params[n]) for n in ("w_gate", "w_up", "w_down")),
                               top_k=K, router_bias=params.get("router_bias"),
                               shared_experts=shared, implementation="cpu")
    ids, w = np.asarray(aux.topk_ids), np.asarray(aux.topk_weights, np.float64)

    def expert(e, t):
        p = pre + s["experts"].format(e=e)
        return _hf_expert(x[t], sd[p + s["gate"]], sd[p + s["up"]], sd[p + s["down"]])

    want = _moe_y(ids, w, expert)
    if shared is not None:
        sp = pre + s["shared"]
        want = want + _hf_expert(x, sd[sp + "gate_proj.weight"], sd[sp + "up_proj.weight"],
                                 sd[sp + "down_proj.weight"])
    assert_close("y", y, want, jnp.float32)
    # the router: HF logits are x @ gate.weight.T
    np.testing.assert_allclose(np.asarray(x, np.float64) @ sd[pre + s["router"]].T,
                               np.asarray(x, np.float64) @ params["router_kernel"], rtol=1e-12)


def test_hf_list_converters_accept_jax_arrays_and_check_shapes():
    g = [jnp.asarray(_rand(F, H)) for _ in range(E)]
    u = [jnp.asarray(_rand(F, H)) for _ in range(E)]
    d = [jnp.asarray(_rand(H, F)) for _ in range(E)]
    wg, wu, wd = convert.experts_from_hf(g, u, d)
    assert isinstance(wg, jax.Array) and wg.shape == (E, H, F) and wd.shape == (E, F, H)
    for a, b in zip(convert.experts_to_hf(wg, wu, wd), (g, u, d)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"down_proj\[2\]"):
        convert.experts_from_hf(g, u, d[:2] + [jnp.zeros((F, H))] + d[3:])
    with pytest.raises(ValueError, match="up_proj has 4 experts"):
        convert.experts_from_hf(g, u[:4], d)
    with pytest.raises(KeyError, match="experts.0.gate_proj.weight"):
        convert.from_hf_state_dict({}, layer_prefix="x.", num_experts=E, style="qwen3_moe")
    with pytest.raises(ValueError, match="style"):
        convert.from_hf_state_dict({}, layer_prefix="x.", num_experts=E, style="gpt2")


@pytest.mark.parametrize("layout", ["te", "legacy"])
def test_megatron_round_trip_and_semantics(layout):
    fc1 = [_rand(2 * F, H) for _ in range(E)]
    fc2 = [_rand(H, F) for _ in range(E)]
    if layout == "legacy":  # GroupedMLP: weight1 [H, E*2F] viewed [E, H, 2F]
        w1 = np.stack([a.T for a in fc1])
        src1, src2 = w1.reshape(H, E * 2 * F), np.stack([a.T for a in fc2]).reshape(E * F, H)
        wg, wu, wd = convert.experts_from_megatron(src1, src2, num_experts=E, hidden_size=H)
        b1, b2 = convert.experts_to_megatron(wg, wu, wd, layout="legacy")
        np.testing.assert_array_equal(b1, src1)
        np.testing.assert_array_equal(b2, src2)
        # Megatron's own math on the legacy tensors
        mw1, mw2 = src1.reshape(E, H, -1), src2.reshape(E, -1, H)
        mlp = lambda e, xt: (lambda h: (_silu(h[:F]) * h[F:]) @ mw2[e])(xt @ mw1[e])
    else:
        wg, wu, wd = convert.experts_from_megatron(fc1, fc2)
        b1, b2 = convert.experts_to_megatron(wg, wu, wd, layout="te")
        for a, b in zip(b1 + b2, fc1 + fc2):
            np.testing.assert_array_equal(a, b)
        mlp = lambda e, xt: (lambda h: (_silu(h[:F]) * h[F:]) @ fc2[e].T)(xt @ fc1[e].T)
    assert wg.shape == (E, H, F) and wd.shape == (E, F, H)
    x, router = _rand(9, H), _rand(H, E)
    ids, w = _route(x, router)
    y = mok_jax.experts(jnp.asarray(x), ids, w.astype(np.float32), jnp.asarray(wg),
                        jnp.asarray(wu), jnp.asarray(wd), implementation="cpu")
    want = _moe_y(ids, w, lambda e, t: mlp(e, np.asarray(x[t], np.float64)))
    assert_close("y", y, want, jnp.float32)
    with pytest.raises(ValueError, match="num_experts"):
        convert.experts_from_megatron(np.zeros((H, E * 2 * F)), np.zeros((E * F, H)))
    with pytest.raises(ValueError, match="layout"):
        convert.experts_to_megatron(wg, wu, wd, layout="fused")


def test_assign_into_an_nnx_module():
    nnx = pytest.importorskip("flax.nnx")
    import mok_jax.nnx as mnnx
    m = mnnx.MoE(H, F, E, K, router_bias=True, rngs=nnx.Rngs(0))
    params = {"router_kernel": _rand(H, E), "w_gate": _rand(E, H, F), "w_up": _rand(E, H, F),
              "w_down": _rand(E, F, H), "router_bias": _rand(E)}
    convert.assign(m, params)
    assert mnnx._get(m.w_gate).dtype == jnp.bfloat16
    np.testing.assert_array_equal(mnnx._get(m.w_up), jnp.asarray(params["w_up"], jnp.bfloat16))
    np.testing.assert_array_equal(mnnx._get(m.router_kernel), params["router_kernel"])
    with pytest.raises(ValueError, match="ws_gate"):
        convert.assign(m, {"ws_gate": _rand(H, FS)})
    with pytest.raises(ValueError, match="w_down has shape"):
        convert.assign(m, {"w_down": _rand(E, H, F)})
