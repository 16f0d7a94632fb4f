"""Expert parallelism (mok_jax.parallel, dispatch="collective") on 2, 4 and 8 CPU
devices: forward and every gradient equal the EP=1 kernel, bitwise where the
design guarantees it; imbalance, empty ranks, a user's own shard_map, bad
meshes, and two processes over jax.distributed (gloo)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from mok_jax import parallel
from helpers import assert_close, fresh_key, make_problem, run_worker_processes

TOL = 1e-5
H, F, FS = 16, 24, 8
MESHES = [((2,), ("expert",)), ((4,), ("expert",)), ((8,), ("expert",)),
          ((2, 2), ("data", "expert")), ((2, 4), ("data", "expert")),
          ((4, 2), ("expert", "data"))]


def _mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    return float(np.max(np.abs(got - want), initial=0.0) /
                 max(float(np.max(np.abs(want), initial=0.0)), 1e-30))


def _assert_close(name, got, want, tol=TOL):
    err = _rel_err(got, want)
    assert err <= tol, f"{name}: relative max error {err:.3g} > {tol}"


def _assert_grads(got, want, names=("x", "router", "w_gate", "w_up", "w_down", "shared")):
    for name, g, w in zip(names, got, want):
        for i, (a, b) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(w))):
            _assert_close(f"d_{name}[{i}]", a, b)


@functools.lru_cache(maxsize=None)  # one jitted function (and compile) per config
def _layer_fn(K, **kw):
    def f(x, router, wg, wu, wd, sh, ct, mask, bias):
        y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                                   token_mask=mask, router_bias=bias, **kw)
        return jnp.sum(y * ct) + 0.1 * aux.load_balancing_loss, (y, aux)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))


def _layer_problem(T, E, K, mask_frac=0.1):
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=FS)
    k1, k2 = jax.random.split(fresh_key())
    ct = jax.random.normal(k1, (T, H))
    mask = jax.random.uniform(k2, (T,)) >= mask_frac
    return [x, router, wg, wu, wd, sh, ct, mask, jnp.zeros((E,), jnp.float32)]


def _compare_layer(args, K, mesh, expert_axis="expert", **kw):
    (l0, (y0, a0)), g0 = _layer_fn(K, implementation="cpu")(*args)
    (l1, (y1, a1)), g1 = _layer_fn(K, mesh=mesh, expert_axis=expert_axis, **kw)(*args)
    # XLA may round the router's matmul differently once x is split over T
    # (measured: ~1 ulp in topk_weights with jax 0.12 on CPU), so y is close to
    # the EP=1 layer, and bitwise equal to the EP=1 kernel run on the mesh's
    # own routing: the source rank's combine replays the kernel's (shared
    # first, then k order).
    _assert_close("y", y1, y0)
    x, _, wg, wu, wd, sh, _, mask, _ = args
    y_same_routing = jax.jit(functools.partial(mok_jax.experts, implementation="cpu"))(
        x, a1.topk_ids, a1.topk_weights, wg, wu, wd, shared_experts=sh, token_mask=mask)
    np.testing.assert_array_equal(y1, y_same_routing)
    np.testing.assert_array_equal(a1.tokens_per_expert, a0.tokens_per_expert)
    np.testing.assert_array_equal(a1.topk_ids, a0.topk_ids)
    # (The losses are sums that GSPMD splits over the mesh: not compared.)
    _assert_grads(g1, g0)
    return a0, g1


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)))
def test_layer_matches_ep1(shape, names):
    E, K, T = 16, 2, 64
    _compare_layer(_layer_problem(T, E, K), K, _mesh(shape, names))


def test_mesh_axis_that_splits_no_tokens():
    """A third mesh axis outside token_axes: everything is replicated over it
    (no psum over it), the result is unchanged."""
    E, K, T = 8, 2, 64
    mesh = _mesh((2, 2, 2), ("data", "expert", "model"))
    _compare_layer(_layer_problem(T, E, K), K, mesh, token_axes=("expert", "data"))


@functools.lru_cache(maxsize=None)
def _experts_fn(**kw):
    def f(x, w, wg, wu, wd, sh, ids, ct):
        fn = parallel.experts_parallel if "mesh" in kw else mok_jax.experts
        y = fn(x, ids, w, wg, wu, wd, shared_experts=sh, **kw)
        return jnp.sum(y * ct), y
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_experts_bitwise(ep):
    """With given routing, y, dx and d_topk_weights are bitwise the EP=1 kernel's
    (the same per-row kernel code, the same fixed combine order); the expert-
    weight gradients too when one round carries everything; sums over ranks
    (shared experts) and over rounds are within 1e-5."""
    T, E, K = 64, 8, 2
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=FS)
    ks = jax.random.split(fresh_key(), 3)
    ids = jax.random.randint(ks[0], (T, K), 0, E)
    w = jax.random.uniform(ks[1], (T, K), minval=0.1)
    ct = jax.random.normal(ks[2], (T, H))
    args = (x, w, wg, wu, wd, sh, ids, ct)
    mesh = _mesh((ep,), ("expert",))
    (_, y0), g0 = _experts_fn(implementation="cpu")(*args)
    one_round = T // ep * K
    for round_rows, weights_bitwise in ((one_round, True), (3, False)):
        (_, y1), g1 = _experts_fn(mesh=mesh, expert_axis="expert", round_rows=round_rows)(*args)
        np.testing.assert_array_equal(y1, y0)
        np.testing.assert_array_equal(g1[0], g0[0])  # dx
        np.testing.assert_array_equal(g1[1], g0[1])  # d_topk_weights
        for i in (2, 3, 4):
            if weights_bitwise:
                np.testing.assert_array_equal(g1[i], g0[i])
            else:
                _assert_close(f"grad {i}", g1[i], g0[i])
        _assert_grads(g1[5:], g0[5:], names=("shared",))


@pytest.mark.parametrize("shape,names,hot", [((4,), ("expert",), 1), ((8,), ("expert",), 7),
                                             ((2, 4), ("data", "expert"), 0)])
def test_all_tokens_to_one_rank(shape, names, hot):
    """Extreme imbalance: a router bias sends every (token, k) pair to the experts
    of one rank; dropless, so every pair is still computed exactly."""
    E, K, T = 16, 2, 64
    mesh = _mesh(shape, names)
    El = E // mesh.shape["expert"]
    args = _layer_problem(T, E, K)
    args[8] = jnp.zeros((E,)).at[hot * El:(hot + 1) * El].set(10.0)
    aux, g = _compare_layer(args, K, mesh)
    counts = np.asarray(aux.tokens_per_expert)
    assert counts[hot * El:(hot + 1) * El].sum() == int(np.sum(args[7])) * K
    assert counts.sum() == counts[hot * El:(hot + 1) * El].sum()
    others = np.ones(E, bool)
    others[hot * El:(hot + 1) * El] = False
    for i in (2, 3, 4):  # experts that received nothing get exact zero gradients
        assert not np.any(np.asarray(g[i])[others])
        assert np.any(np.asarray(g[i])[~others])


def test_empty_ranks_send_and_receive_nothing():
    """Ranks 0-1 own no token (all masked) and ranks 2-3 receive none (their
    experts are biased away); the other ranks still match EP=1."""
    E, K, T, ep = 16, 2, 64, 8
    mesh = _mesh((ep,), ("expert",))
    El, Tl = E // ep, T // ep
    args = _layer_problem(T, E, K, mask_frac=0.0)
    args[7] = args[7].at[:2 * Tl].set(False)
    args[8] = jnp.zeros((E,)).at[2 * El:4 * El].set(-10.0)
    aux, g = _compare_layer(args, K, mesh)
    assert not np.any(np.asarray(aux.tokens_per_expert)[2 * El:4 * El])
    assert not np.any(np.asarray(g[0])[:2 * Tl])  # masked tokens: zero dx


def test_all_tokens_masked():
    """No pair anywhere: zero rounds; y and the expert gradients are exact zeros."""
    E, K, T = 8, 2, 32
    args = _layer_problem(T, E, K)
    args[7] = jnp.zeros((T,), bool)
    _, g = _compare_layer(args, K, _mesh((4,), ("expert",)))
    for i in (0, 2, 3, 4):
        assert not np.any(np.asarray(g[i]))


def test_round_count_and_buffer_size():
    """The dispatch runs in rounds of fixed-size buffers: C = ceil(2*T_local*K/EP)
    pairs per destination, so balanced routing takes one round and all pairs to
    one rank take ceil(EP/2); the trip count is the same on every rank."""
    ep, El, Tl, K = 8, 2, 16, 2
    C = parallel._round_rows(Tl, K, ep, None)
    assert C == -(-2 * Tl * K // ep)
    mesh = _mesh((ep,), ("expert",))
    cfg = parallel.EPConfig(impl="cpu", axis="expert", ep=ep, round_rows=C,
                            sync_axes=("expert",))
    rounds = jax.jit(jax.shard_map(
        lambda ids, m: parallel._plan(cfg, ids, m, El).rounds[None],
        mesh=mesh, in_specs=(P("expert"), P("expert")), out_specs=P("expert")))
    mask = jnp.ones((ep * Tl,), bool)
    perm = jax.random.permutation(fresh_key(), ep * El)
    balanced = jnp.stack([perm[jnp.arange(ep * Tl) % (ep * El)],
                          perm[(jnp.arange(ep * Tl) + 1) % (ep * El)]], 1)
    np.testing.assert_array_equal(rounds(balanced, mask), 1)
    hot = jnp.broadcast_to(jnp.array([6, 7], jnp.int32), (ep * Tl, K))  # all to rank 3
    np.testing.assert_array_equal(rounds(hot, mask), -(-Tl * K // C))
    assert -(-Tl * K // C) == ep // 2
    np.testing.assert_array_equal(rounds(hot, jnp.zeros_like(mask)), 0)
    one_rank_live = mask.at[Tl:].set(False)  # only rank 0 sends: still one trip count
    np.testing.assert_array_equal(rounds(hot, one_rank_live), ep // 2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_user_shard_map(check_vma):
    """The layer called inside the user's own shard_map with axis_name=: local
    tokens, the rank's E/EP block of experts, replicated router and shared. With
    check_vma, data group 0 has all tokens masked (zero rounds) while group 1
    runs: the groups' trip counts differ."""
    E, K, T = 16, 2, 64
    mesh = _mesh((2, 4), ("data", "expert"))
    tok, ew = P(("data", "expert"), None), P("expert", None, None)
    args = _layer_problem(T, E, K)
    if check_vma:
        args[7] = args[7].at[:T // 2].set(False)

    def body(x, router, wg, wu, wd, sh, ct, mask):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                                 token_mask=mask, axis_name="expert")
        return jax.lax.psum(jnp.sum(y * ct), ("data", "expert")), y

    def loss(x, router, wg, wu, wd, sh, ct, mask):
        f = jax.shard_map(body, mesh=mesh, check_vma=check_vma,
                          in_specs=(tok, P(), ew, ew, ew, P(), tok, P(("data", "expert"))),
                          out_specs=(P(), tok))
        return f(x, router, wg, wu, wd, sh, ct, mask)

    (l1, y1), g1 = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)),
                                              has_aux=True))(*args[:8])

    def ref(x, router, wg, wu, wd, sh, ct, mask):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                                 token_mask=mask, implementation="cpu")
        return jnp.sum(y * ct), y

    (l0, y0), g0 = jax.jit(jax.value_and_grad(ref, argnums=tuple(range(6)),
                                              has_aux=True))(*args[:8])
    # Close, not bitwise: the router's matmul on T/8 rows may round differently
    # (the kernel-level bitwise claim is test_experts_bitwise's).
    _assert_close("y", y1, y0)
    _assert_grads(g1, g0)


def test_bfloat16_and_xla_per_rank_kernel():
    """bf16 through the CPU kernel (bf16 tolerance: the routed rows come back
    rounded to bf16), and the pure-JAX per-rank path (implementation='xla')."""
    E, K, T = 8, 2, 64
    mesh = _mesh((4,), ("expert",))
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, dtype=jnp.bfloat16, shared_ffn=FS)
    f = lambda **kw: jax.jit(jax.value_and_grad(
        lambda x, wg: jnp.sum(mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K,
                                                shared_experts=sh, **kw)[0]
                              .astype(jnp.float32) ** 2), argnums=(0, 1)))(x, wg)
    l0, g0 = f(implementation="cpu")
    l1, g1 = f(implementation="cpu", mesh=mesh, expert_axis="expert")
    assert_close("bf16 loss", l1, l0, jnp.bfloat16)
    for a, b in zip(g1, g0):
        assert_close("bf16 grad", a, b, jnp.bfloat16)

    args = _layer_problem(T, E, K)
    (l0, (y0, _)), g0 = _layer_fn(K, implementation="xla")(*args)
    (l1, (y1, _)), g1 = _layer_fn(K, implementation="xla", mesh=mesh, expert_axis="expert")(*args)
    _assert_close("xla y", y1, y0)
    _assert_grads(g1, g0)


def test_eager_call_without_jit():
    E, K, T = 8, 2, 32
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=FS)
    mesh = _mesh((2, 2), ("data", "expert"))
    # Both eager: a jitted router may round a weight differently (fusion) than
    # the eager one, which would make the comparison depend on the data.
    y0, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                              implementation="cpu")
    y1, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                              mesh=mesh, expert_axis="expert", token_axes=("data", "expert"))
    np.testing.assert_array_equal(y1, y0)


def test_under_checkpoint():
    """jax.checkpoint around the mesh layer: the same gradients (its custom_vjp
    keeps only the inputs, so there is nothing extra to save or recompute)."""
    E, K, T = 8, 2, 32
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, shared_ffn=FS)
    mesh = _mesh((4,), ("expert",))
    loss = lambda x, wg: jnp.sum(mok_jax.moe_layer(
        x, router, wg, wu, wd, top_k=K, shared_experts=sh, mesh=mesh,
        expert_axis="expert")[0] ** 2)
    g0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, wg)
    g1 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, wg)
    for a, b in zip(g1, g0):
        np.testing.assert_array_equal(a, b)


def test_bad_meshes_and_options():
    E, K, T = 6, 2, 32
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E)
    call = lambda **kw: mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, **kw)
    m4 = _mesh((4,), ("expert",))
    with pytest.raises(ValueError, match=r"E=6 .*expert_axis='expert' of size 4"):
        call(mesh=m4, expert_axis="expert")
    with pytest.raises(ValueError, match=r"expert_axis='ep' is not an axis of the mesh"):
        call(mesh=m4, expert_axis="ep")
    with pytest.raises(ValueError, match="expert_axis is required"):
        call(mesh=m4)
    m2 = _mesh((2, 2), ("data", "expert"))
    with pytest.raises(ValueError, match="token_axes.*must include expert_axis"):
        call(mesh=m2, expert_axis="expert", token_axes=("data",))
    with pytest.raises(ValueError, match="token_axes contains 'model'"):
        call(mesh=m2, expert_axis="expert", token_axes=("expert", "model"))
    with pytest.raises(ValueError, match=r"T=30 tokens.*token_axes=\('expert', 'data'\)"):
        mok_jax.moe_layer(x[:30], router, wg, wu, wd, top_k=K, mesh=m2, expert_axis="expert")
    with pytest.raises(ValueError, match="dispatch='ring' is not supported"):
        call(mesh=_mesh((2,), ("expert",)), expert_axis="expert", dispatch="ring")
    with pytest.raises(ValueError, match="expert_axis= and token_axes= need mesh="):
        call(expert_axis="expert")
    with pytest.raises(ValueError, match="not both"):
        call(mesh=m2, expert_axis="expert", axis_name="expert")
    with pytest.raises(ValueError, match="w_gate has E=3 experts but router_kernel has 6"):
        mok_jax.moe_layer(x, router, wg[:3], wu[:3], wd[:3], top_k=K,
                          mesh=_mesh((3,), ("expert",)), expert_axis="expert")

    def inner(x, wg, wu, wd):  # the full [E, ...] weights inside shard_map: wrong
        return mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, axis_name="expert")[0]
    with pytest.raises(ValueError, match="this rank's block of E/EP experts"):
        jax.shard_map(inner, mesh=_mesh((2,), ("expert",)),
                      in_specs=(P("expert"), P(), P(), P()), out_specs=P("expert"))(x, wg, wu, wd)


def test_out_of_range_ids_are_skipped():
    """A pair whose id is outside [0, E) contributes nothing (as in the CUDA
    kernel): y equals EP=1 with that pair's weight set to zero."""
    E, K, T = 8, 2, 32
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E)
    k1, k2 = jax.random.split(fresh_key())
    ids = jax.random.randint(k1, (T, K), 0, E)
    w = jax.random.uniform(k2, (T, K), minval=0.1)
    bad = ids.at[5, 1].set(E + 3).at[20, 0].set(-1)
    y = parallel.experts_parallel(x, bad, w, wg, wu, wd, mesh=_mesh((4,), ("expert",)),
                                  expert_axis="expert")
    w0 = w.at[5, 1].set(0.0).at[20, 0].set(0.0)
    np.testing.assert_array_equal(y, mok_jax.experts(x, ids, w0, wg, wu, wd,
                                                     implementation="cpu"))


@pytest.mark.skipif(not mok_jax.cuda_built(), reason="CUDA backend not built here")
def test_cuda_path_lowers_for_gpu():
    """Without a GPU: the mesh path with implementation='cuda' traces and lowers
    for CUDA (the local kernel inside the dispatch loop, the shared expert
    through the F=8 dummy), forward and gradient."""
    E, K, T = 8, 2, 256
    x, router, wg, wu, wd, sh = make_problem(T, 64, 64, E, dtype=jnp.bfloat16, shared_ffn=64)
    mesh = _mesh((4,), ("expert",))
    f = lambda x, wg, sh: jnp.sum(mok_jax.moe_layer(
        x, router, wg, wu, wd, top_k=K, shared_experts=sh, mesh=mesh, expert_axis="expert",
        implementation="cuda")[0].astype(jnp.float32) ** 2)
    for fn, loops in ((f, 1), (jax.grad(f, argnums=(0, 1, 2)), 2)):
        hlo = jax.jit(fn).trace(x, wg, sh).lower(lowering_platforms=("cuda",)).as_text()
        assert hlo.count("mok_experts_fwd_cuda") >= 2  # routed rounds + shared expert
        assert "all_to_all" in hlo and hlo.count("stablehlo.while") >= loops


def test_two_processes_gloo():
    """Two processes on localhost (jax.distributed, gloo CPU collectives), 2 CPU
    devices each: data x expert and expert=4 meshes whose expert axis spans both
    processes run dispatch='collective' and match EP=1; dispatch='peer' there
    is refused with a clear error."""
    worker = os.path.join(os.path.dirname(__file__), "ep_worker.py")
    seed = int(jax.random.randint(fresh_key(), (), 0, 2**30))
    run_worker_processes(worker, lambda i, port: (i, 2, port, seed), 2, "EP_WORKER_OK",
                         dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
