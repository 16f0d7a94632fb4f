"""A forward that nothing differentiates (inference, evaluation) keeps no
residuals: the FFI forward gets its gate/up pre-activation results with 0
rows and writes the activations only. Its y must be bitwise the y of the
differentiated forward, which keeps them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _ffi
from mok_jax.experts import empty_shared
from helpers import make_problem

T, H, F, E, K = 300, 64, 48, 8, 2


def _routing(T, seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    ids = jnp.argsort(jax.random.uniform(ks[0], (T, E)), axis=1)[:, :K].astype(jnp.int32)
    w = jax.random.uniform(ks[1], (T, K), minval=0.1)
    mask = jax.random.uniform(ks[2], (T,)) > 0.2
    return ids, w, mask


def _fwd_results(f, *args):
    """The result shapes of every mok_experts_fwd FFI call in f's jaxpr."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ffi_call" and "mok_experts_fwd" in eqn.params["target_name"]:
                found.append([tuple(v.aval.shape) for v in eqn.outvars])
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


@pytest.mark.parametrize("Fs", [0, 16])
def test_undifferentiated_forward_drops_the_pre_activations(Fs):
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=Fs)
    ids, w, mask = _routing(T, seed=Fs)

    def f(x, w, wg, wu, wd):
        return mok_jax.experts(x, ids, w, wg, wu, wd, shared_experts=sh, token_mask=mask,
                               implementation="cpu")

    args = (x, w, wg, wu, wd)
    (primal,) = _fwd_results(f, *args)
    assert primal[4:] == [(0, F), (0, F), (0, Fs), (0, Fs)], primal
    (kept,) = _fwd_results(lambda *a: jax.vjp(f, *a)[0], *args)
    R = kept[2][0]
    assert R >= T * K and kept[4:] == [(R, F), (R, F), (T, Fs), (T, Fs)], kept

    y_inference = jax.jit(f)(*args)
    y_train, vjp = jax.vjp(f, *args)
    assert np.array_equal(np.asarray(y_inference), np.asarray(y_train))
    assert float(jnp.abs(y_inference).max()) > 0.1, "a real output, not zeros"
    assert np.all(np.asarray(y_inference)[~np.asarray(mask)] == 0), "masked tokens stay exact zeros"
    # the differentiated path still has what its backward needs
    grads = vjp(jnp.ones_like(y_train))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_grad_and_checkpoint_keep_the_pre_activations():
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    ids, w, _ = _routing(T, seed=3)
    loss = lambda x, wg, rc: jnp.sum(mok_jax.experts(x, ids, w, wg, wu, wd, implementation="cpu",
                                                     recompute=rc) ** 2)
    for rc in (False, True):
        calls = _fwd_results(jax.grad(lambda x, wg: loss(x, wg, rc), argnums=(0, 1)), x, wg)
        assert calls and all(c[4][0] > 0 for c in calls), (rc, calls)


def test_the_ffi_forward_refuses_partly_dropped_pre_activations():
    """The kernels accept the four pre-activation results whole or all with
    0 rows; anything else is a clear error naming the result."""
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    ids, w, mask = _routing(T, seed=4)
    wsg, wsu, wsd = empty_shared(H, x.dtype, False)
    inputs = (x, ids, w, mask.astype(jnp.uint8), wg, wu, wd, wsg, wsu, wsd)
    types = list(_ffi.forward_result_types(x, ids, wg, wsg, keep_pre=False))
    types[5] = jax.ShapeDtypeStruct((types[2].shape[0], F), x.dtype)  # up_pre whole, gate_pre not
    with pytest.raises(Exception, match="up_pre"):
        jax.block_until_ready(jax.ffi.ffi_call("mok_experts_fwd_cpu", tuple(types))(*inputs))
