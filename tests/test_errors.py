"""Bad input: trace-time ValueError/TypeError naming the argument, and the
kernel's own check of ids it cannot see at trace time."""

import jax
import jax.numpy as jnp
import pytest

import mok_jax
from helpers import make_problem


@pytest.fixture
def prob():
    return make_problem(16, 8, 12, 4)


def _layer(prob, **kw):
    x, router, wg, wu, wd, _ = prob
    args = dict(x=x, router_kernel=router, w_gate=wg, w_up=wu, w_down=wd)
    args.update({k: v for k, v in kw.items() if k in args})
    opts = dict(top_k=2, implementation="cpu")
    opts.update({k: v for k, v in kw.items() if k not in args})
    return mok_jax.moe_layer(args.pop("x"), args.pop("router_kernel"), args.pop("w_gate"),
                             args.pop("w_up"), args.pop("w_down"), **opts)


@pytest.mark.parametrize("kw, err, match", [
    (dict(top_k=0), ValueError, r"top_k=0 must be in \[1, 4\]"),
    (dict(top_k=5), ValueError, r"top_k=5 must be in \[1, 4\]"),
    (dict(top_k=2.0), TypeError, "top_k must be a Python int"),
    (dict(score_func="relu"), ValueError, "score_func='relu'"),
    (dict(implementation="triton"), ValueError, "implementation='triton'"),
    (dict(router_kernel=jnp.zeros((9, 4))), ValueError, r"router_kernel has shape \(9, 4\)"),
    (dict(router_kernel=jnp.zeros((8,))), ValueError, "router_kernel must have rank 2"),
    (dict(w_gate=jnp.zeros((4, 8))), ValueError, r"w_gate must have rank 3 \(\[E, H, F\]\)"),
    (dict(w_gate=jnp.zeros((4, 9, 12))), ValueError, "w_gate has shape"),
    (dict(w_up=jnp.zeros((4, 8, 11))), ValueError, r"w_up has shape \(4, 8, 11\), expected \(4, 8, 12\)"),
    (dict(w_down=jnp.zeros((4, 8, 12))), ValueError, r"w_down has shape \(4, 8, 12\), expected \(4, 12, 8\)"),
    (dict(w_up=jnp.zeros((4, 8, 12), jnp.bfloat16)), TypeError, "w_up has dtype bfloat16 but x"),
    (dict(x=jnp.zeros((16, 8), jnp.int32)), TypeError, "x has dtype int32"),
    (dict(token_mask=jnp.ones((15,), bool)), ValueError, "token_mask has shape"),
    (dict(token_mask=jnp.ones((16,), jnp.int32)), TypeError, "token_mask has dtype int32"),
    (dict(router_bias=jnp.zeros((5,))), ValueError, r"router_bias has shape \(5,\)"),
    (dict(shared_experts=(jnp.zeros((8, 4)), jnp.zeros((8, 4)), jnp.zeros((4, 9)))),
     ValueError, r"ws_down\) has shape \(4, 9\), expected \(4, 8\)"),
])
def test_bad_arguments_raise_at_trace_time(prob, kw, err, match):
    with pytest.raises(err, match=match):
        jax.jit(lambda: _layer(prob, **kw)).trace()


def test_experts_bad_routing_shapes(prob):
    x, _, wg, wu, wd, _ = prob
    with pytest.raises(ValueError, match="topk_ids has shape"):
        mok_jax.experts(x, jnp.zeros((15, 2), jnp.int32), jnp.ones((15, 2)), wg, wu, wd)
    with pytest.raises(ValueError, match="topk_weights has shape"):
        mok_jax.experts(x, jnp.zeros((16, 2), jnp.int32), jnp.ones((16, 3)), wg, wu, wd)
    with pytest.raises(TypeError, match="topk_ids has dtype float32"):
        mok_jax.experts(x, jnp.zeros((16, 2)), jnp.ones((16, 2)), wg, wu, wd)


@pytest.mark.parametrize("bad", [4, -1, 1 << 20])
def test_out_of_range_ids_are_reported_by_the_kernel(prob, bad):
    x, _, wg, wu, wd, _ = prob
    ids = jnp.zeros((16, 2), jnp.int32).at[3, 1].set(bad)
    with pytest.raises(Exception, match=rf"topk_ids\[3, 1\] = {bad} is outside \[0, 4\)"):
        jax.block_until_ready(mok_jax.experts(x, ids, jnp.ones((16, 2)), wg, wu, wd,
                                              implementation="cpu"))


def test_cuda_unavailable_is_a_clear_error(prob, monkeypatch):
    from mok_jax import _ffi
    monkeypatch.setattr(_ffi, "_mok_cuda", None)
    monkeypatch.setattr(_ffi, "CUDA_UNAVAILABLE_REASON", "not built")
    with pytest.raises(ValueError, match="implementation='cuda' needs mok_jax's CUDA backend"):
        _layer(prob, implementation="cuda")


def test_cuda_rejects_float32(prob):
    from mok_jax import _ffi
    if not _ffi.cuda_built():
        pytest.skip("CUDA backend not built")
    with pytest.raises(NotImplementedError, match="bfloat16 only"):
        _layer(prob, implementation="cuda")


def test_cuda_shape_limits_are_clear_errors():
    from mok_jax import _ffi
    if not _ffi.cuda_built():
        pytest.skip("CUDA backend not built")
    x, router, wg, wu, wd, _ = make_problem(16, 12, 16, 4, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="H to be a multiple of 8"):
        mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation="cuda")


def test_auto_on_cpu_uses_the_cpu_kernel(prob):
    x, router, wg, wu, wd, _ = prob
    hlo = jax.jit(lambda *a: mok_jax.moe_layer(*a, top_k=2)[0]).lower(
        x, router, wg, wu, wd).as_text()
    assert "mok_experts_fwd_cpu" in hlo
