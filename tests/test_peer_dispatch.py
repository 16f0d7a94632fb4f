"""dispatch="peer" on 2, 4 and 8 CPU devices of one process (ffi/peer_cpu.h):
each rank's FFI call pulls the rows routed to its experts straight from the
owners' x and writes the results into the owners' return rows; the
protocol's generation counters, timeouts and errors are the CUDA path's
(ffi/peer_forward.h). The backward is the same protocol (x and dy rows pulled,
pre-activations recomputed, d_x rows and d_topk_weights written back). With
given routing, y, dx, d_topk_weights and the expert-weight gradients are
bitwise the EP=1 kernel's (each expert's gradient sums its rows in global
pair order, as at EP=1); the shared expert's, summed over ranks, within 1e-5."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from mok_jax import _ffi, parallel
from helpers import fresh_key, make_problem
from test_expert_parallel import (FS, H, F, MESHES, _assert_close, _compare_layer, _experts_fn,
                                  _layer_problem, _mesh)


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)))
def test_peer_layer_matches_ep1(shape, names):
    E, K, T = 16, 2, 64
    _compare_layer(_layer_problem(T, E, K), K, _mesh(shape, names), dispatch="peer")


@pytest.mark.parametrize("ep,dtype", [(1, jnp.float32), (2, jnp.float32), (4, jnp.float32),
                                      (8, jnp.float32), (4, jnp.bfloat16)])
def test_peer_experts_bitwise_and_repeatable(ep, dtype):
    """Given routing: y and every routed gradient bitwise the EP=1 kernel's,
    every call (the counters only grow); the shared expert's within 1e-5."""
    T, E, K = 64, 8, 2
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=FS, dtype=dtype)
    ks = jax.random.split(fresh_key(), 3)
    ids = jax.random.randint(ks[0], (T, K), 0, E)
    w = jax.random.uniform(ks[1], (T, K), minval=0.1)
    ct = jax.random.normal(ks[2], (T, H))
    args = (x, w, wg, wu, wd, sh, ids, ct)
    (_, y0), g0 = _experts_fn(implementation="cpu")(*args)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: the shared grads' psum rounds
    f = _experts_fn(mesh=_mesh((ep,), ("expert",)), expert_axis="expert", dispatch="peer")
    for _ in range(3):
        (_, y1), g1 = f(*args)
        np.testing.assert_array_equal(y1, y0)
        for i in range(5):  # dx, d_topk_weights, dw_gate, dw_up, dw_down
            np.testing.assert_array_equal(g1[i], g0[i])
        for a, b in zip(jax.tree.leaves(g1[5]), jax.tree.leaves(g0[5])):
            _assert_close("shared grad", a, b, tol)


@pytest.mark.parametrize("shape,names,hot", [((4,), ("expert",), 1), ((8,), ("expert",), 7),
                                             ((2, 4), ("data", "expert"), 0)])
def test_peer_all_tokens_to_one_rank(shape, names, hot):
    """Every pair to one rank's experts: that rank computes all of them
    (no capacity, no drop), the others none."""
    E, K, T = 16, 2, 64
    mesh = _mesh(shape, names)
    El = E // mesh.shape["expert"]
    args = _layer_problem(T, E, K)
    args[8] = jnp.zeros((E,)).at[hot * El:(hot + 1) * El].set(10.0)
    aux, _ = _compare_layer(args, K, mesh, dispatch="peer")
    counts = np.asarray(aux.tokens_per_expert)
    assert counts[hot * El:(hot + 1) * El].sum() == int(np.sum(args[7])) * K


def test_peer_empty_ranks_and_all_masked():
    E, K, T, ep = 16, 2, 64, 8
    mesh = _mesh((ep,), ("expert",))
    El, Tl = E // ep, T // ep
    args = _layer_problem(T, E, K, mask_frac=0.0)
    args[7] = args[7].at[:2 * Tl].set(False)  # ranks 0-1 own no token
    args[8] = jnp.zeros((E,)).at[2 * El:4 * El].set(-10.0)  # ranks 2-3 receive none
    _compare_layer(args, K, mesh, dispatch="peer")
    args[7] = jnp.zeros((T,), bool)
    _, g = _compare_layer(args, K, mesh, dispatch="peer")
    for i in (0, 2, 3, 4):
        assert not np.any(np.asarray(g[i]))


def test_peer_devices_attribute():
    """Rank-major groups along the expert axis, whatever the mesh's axis order."""
    mesh = _mesh((2, 4), ("data", "expert"))
    ids = [d.id for d in jax.devices()[:8]]
    assert parallel._peer_devices(mesh, "expert") == tuple(ids)
    mesh = _mesh((4, 2), ("expert", "data"))
    grid = np.array(ids).reshape(4, 2)
    assert parallel._peer_devices(mesh, "expert") == tuple(grid.T.reshape(-1))


def test_peer_lost_peer_is_an_error():
    """A rank whose peer never joins fails after the timeout with a message
    naming the missing rank, instead of hanging."""
    T, E, K = 8, 4, 1
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    dev = jax.devices()[7]
    inputs = (x, jnp.zeros((T, K), jnp.int32), jnp.ones((T, K), jnp.float32),
              jnp.ones((T,), jnp.uint8), wg[:2], wu[:2], wd[:2], jnp.zeros((H, 0)),
              jnp.zeros((H, 0)), jnp.zeros((0, H)))
    inputs = jax.device_put(inputs, dev)
    # A group (device 7, device 5) that no other test uses: rank 1 never comes.
    call = jax.jit(lambda *a: _ffi.peer_forward_call("cpu", a, (7, 5), 2, 300))
    with pytest.raises(Exception, match=r"rank 0 waited 300 ms for rank\(s\) 1 .*lost peer"):
        jax.block_until_ready(call(*inputs))


def test_peer_bad_options():
    E, K, T = 8, 2, 32
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E)
    mesh = _mesh((2,), ("expert",))
    with pytest.raises(ValueError, match="dispatch='peer' runs the library's own kernels"):
        mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, mesh=mesh, expert_axis="expert",
                          dispatch="peer", implementation="xla")

    def body(x, router, wg, wu, wd):
        return mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, axis_name="expert",
                                 dispatch="peer")[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P(), P("expert"), P("expert"),
                                                 P("expert")), out_specs=P("expert"))
    with pytest.raises(NotImplementedError, match="dispatch='peer' needs mesh="):
        jax.jit(f)(x, router, wg, wu, wd)


def test_peer_under_checkpoint_and_between_other_calls():
    """jax.checkpoint around the peer layer gives the same gradients; peer
    programs of two token counts, with a collective one in between, share
    the group's counters and all stay exact."""
    E, K = 8, 2
    mesh = _mesh((4,), ("expert",))
    x, router, wg, wu, wd, sh = make_problem(64, H, F, E, shared_ffn=FS)

    def loss(x, wg, dispatch="peer", recompute=False):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh, mesh=mesh,
                                 expert_axis="expert", dispatch=dispatch, recompute=recompute)
        return jnp.sum(y ** 2)

    g0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, wg)
    g1 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, wg)
    g2 = jax.jit(jax.grad(lambda x, wg: loss(x, wg, recompute=True), argnums=(0, 1)))(x, wg)
    for a, b, c in zip(g1, g0, g2):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, b)
    for T in (32, 64):
        gc = jax.jit(jax.grad(lambda x, wg: loss(x, wg, "collective"), argnums=(0, 1)))(x[:T], wg)
        gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x[:T], wg)
        for a, b in zip(gp, gc):
            _assert_close("peer vs collective", a, b)


def test_peer_bad_expert_id_is_an_error_not_a_hang():
    """An id outside [0, E) on one rank: every rank still finishes the call
    (the pair is skipped everywhere) and the owner reports the id."""
    T, E, K = 64, 8, 2
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    ids = jax.random.randint(fresh_key(), (T, K), 0, E).at[3, 1].set(E + 5)
    w = jnp.ones((T, K), jnp.float32)
    f = jax.jit(lambda x, ids: parallel.experts_parallel(
        x, ids, w, wg, wu, wd, mesh=_mesh((4,), ("expert",)), expert_axis="expert",
        implementation="cpu", dispatch="peer"))
    with pytest.raises(Exception, match=r"topk_ids: expert id 13 is outside \[0, 8\)"):
        jax.block_until_ready(f(x, ids))
    y = f(x, ids.at[3, 1].set(0))  # the group still works afterwards
    assert np.all(np.isfinite(np.asarray(y)))
