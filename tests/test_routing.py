"""`route`: selection, weights and aux values against the NumPy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
import numpy_reference as npref
from helpers import make_problem


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_matches_reference(score, normalize, with_bias):
    x, router, *_ = make_problem(333, 20, 8, 16)
    bias = jnp.linspace(-0.3, 0.2, 16) if with_bias else None
    aux = mok_jax.route(x, router, top_k=4, score_func=score, normalize_topk=normalize,
                        router_bias=bias, routed_scaling_factor=2.5)
    ids, w, counts, lb, z = npref.route(x, router, 4, score, normalize, bias, 2.5)
    np.testing.assert_array_equal(aux.topk_ids, ids)
    np.testing.assert_allclose(aux.topk_weights, w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    np.testing.assert_allclose(aux.load_balancing_loss, lb, rtol=1e-5)
    np.testing.assert_allclose(aux.router_z_loss, z, rtol=1e-5)
    assert aux.tokens_per_expert.dtype == jnp.int32 and int(aux.tokens_per_expert.sum()) == 333 * 4


def test_bias_changes_selection_not_weights():
    x, router, *_ = make_problem(64, 8, 8, 6)
    big = jnp.array([0, 0, 0, 0, 0, 10.0])
    aux = mok_jax.route(x, router, top_k=1, router_bias=big, normalize_topk=False)
    assert np.all(np.asarray(aux.topk_ids) == 5)
    scores = np.asarray(jnp.asarray(x) @ router)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(aux.topk_weights[:, 0], (e / e.sum(-1, keepdims=True))[:, 5],
                               rtol=2e-5)


def test_identical_logits_break_ties_by_lowest_id():
    x = jnp.ones((10, 8))
    router = jnp.zeros((8, 5))
    aux = mok_jax.route(x, router, top_k=3)
    np.testing.assert_array_equal(aux.topk_ids, np.tile([0, 1, 2], (10, 1)))
    np.testing.assert_allclose(aux.topk_weights, 1 / 3, rtol=1e-6)
