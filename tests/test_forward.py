"""Forward: the CPU FFI kernel and the XLA reference against the float64 NumPy
reference, over a grid of shapes, score functions, biases, shared experts and
dtypes (fresh random inputs per case)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
import numpy_reference as npref
from helpers import assert_close, make_problem, rel_l2

F32, BF16 = jnp.float32, jnp.bfloat16
# (T, H, F, E, K, score_func, with_bias, shared_ffn, dtype)
CASES = [
    (1, 8, 8, 1, 1, "softmax", False, 0, F32),
    (7, 13, 9, 4, 2, "sigmoid", True, 0, F32),
    (100, 24, 40, 8, 8, "softmax", False, 16, F32),     # k = E
    (257, 17, 31, 16, 4, "sigmoid", True, 12, BF16),
    (1000, 32, 48, 64, 6, "softmax", True, 0, BF16),    # E = 64
    (3001, 16, 24, 32, 2, "softmax", False, 8, F32),    # a few thousand, odd T
    (129, 40, 56, 5, 5, "sigmoid", False, 20, BF16),    # k = E, bf16
]
IDS = [f"T{c[0]}-H{c[1]}-F{c[2]}-E{c[3]}-k{c[4]}-{c[5]}-bias{int(c[6])}-Fs{c[7]}-"
       f"{jnp.dtype(c[8]).name}" for c in CASES]


def _layer(x, router, wg, wu, wd, shared, case, impl):
    T, H, F, E, K, score, with_bias, _, _ = case
    bias = jnp.linspace(-0.1, 0.1, E) if with_bias else None
    return jax.jit(lambda *a: mok_jax.moe_layer(
        *a, top_k=K, score_func=score, router_bias=bias, shared_experts=shared,
        implementation=impl))(x, router, wg, wu, wd)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_float64_reference(case):
    T, H, F, E, K, score, with_bias, Fs, dtype = case
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, dtype, Fs)
    y_cpu, aux = _layer(x, router, wg, wu, wd, shared, case, "cpu")
    y_xla, aux_x = _layer(x, router, wg, wu, wd, shared, case, "xla")
    np.testing.assert_array_equal(aux.topk_ids, aux_x.topk_ids)
    assert y_cpu.dtype == dtype and y_cpu.shape == x.shape
    want = npref.experts(x, np.asarray(aux.topk_ids), np.asarray(aux.topk_weights), wg, wu, wd,
                         shared)
    assert_close("y (cpu)", y_cpu, want, dtype)
    assert_close("y (xla)", y_xla, want, dtype)
    # The two JAX-side implementations share the precision contract exactly.
    assert rel_l2(y_cpu.astype(F32), y_xla.astype(F32)) <= (1e-2 if dtype == BF16 else 1e-6)


def test_experts_leading_batch_dims():
    x, router, wg, wu, wd, _ = make_problem(None, 16, 24, 6, lead=(3, 5, 7))
    y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=2, implementation="cpu")
    assert y.shape == (3, 5, 7, 16) and aux.topk_ids.shape == (3, 5, 7, 2)
    y2, _ = mok_jax.moe_layer(x.reshape(-1, 16), router, wg, wu, wd, top_k=2,
                              implementation="cpu")
    np.testing.assert_array_equal(y.reshape(-1, 16), y2)


def test_multiple_shared_experts_add():
    x, router, wg, wu, wd, s1 = make_problem(50, 16, 24, 4, shared_ffn=8)
    _, _, _, _, _, s2 = make_problem(50, 16, 24, 4, shared_ffn=12)
    ids = jnp.zeros((50, 1), jnp.int32)
    w = jnp.ones((50, 1))
    both = mok_jax.experts(x, ids, w, wg, wu, wd, shared_experts=[s1, s2], implementation="cpu")
    want = (npref.experts(x, np.zeros((50, 1), int), np.ones((50, 1)), wg, wu, wd, s1)
            + npref.experts(x, np.zeros((50, 1), int), np.zeros((50, 1)), wg, wu, wd, s2))
    assert_close("y", both, want, F32)


def test_empty_batch():
    x, router, wg, wu, wd, _ = make_problem(0, 8, 8, 2)
    y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=1, implementation="cpu")
    assert y.shape == (0, 8)
