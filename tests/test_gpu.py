"""GPU tests of the CUDA backend (`pytest -m gpu` on an H100/H200 host).

The float64 NumPy reference judges small shapes; for the benchmark shapes at
reduced T the judge is the XLA reference on float32-upcast inputs, and the
gradients are compared on the device (helpers.assert_close_on_device,
checked against the float64 metrics in tests/test_helpers.py). Output
poisoning and the schedule tensors are checked by tests/cuda/forward_standalone.cu.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _ffi
import numpy_reference as npref
from helpers import (assert_close, assert_close_on_device, bitwise_equal, curve_gap, fresh_key,
                     load_train_example, make_problem)

pytestmark = pytest.mark.gpu
BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _need_cuda():
    if jax.default_backend() != "gpu" or not _ffi.cuda_built() or not _ffi.cuda_device_supported():
        pytest.skip("needs an sm_90 GPU and the CUDA backend")


def _cuda(x, ids, w, wg, wu, wd, shared=None, mask=None):
    return jax.jit(lambda *a: mok_jax.experts(*a, shared_experts=shared, token_mask=mask,
                                              implementation="cuda"))(x, ids, w, wg, wu, wd)


def _f32_reference(x, ids, w, wg, wu, wd, shared=None, mask=None):
    up = lambda a: a.astype(jnp.float32)
    sh = None if shared is None else tuple(map(up, shared))
    return mok_jax.experts(up(x), ids, w, up(wg), up(wu), up(wd), shared_experts=sh,
                           token_mask=mask, implementation="xla")


def _edge_routing(kind, T, E, K, *, one_expert=7, experts_used=3, p_mask=0.5):
    """(topk_ids, K, token_mask) of an edge case: every token to `one_expert`,
    only the first `experts_used` experts (the rest empty), k = E, k = 1, a
    `p_mask` share of the tokens masked, or all of them; any other kind: uniform
    routing, no mask."""
    ids = jax.random.randint(fresh_key(), (T, K), 0, E)
    mask = None
    if kind == "one_expert":
        ids = jnp.full((T, K), one_expert, jnp.int32)
    elif kind == "empty_experts":
        ids = ids % experts_used
    elif kind == "k_equals_e":
        K = E
        ids = jnp.tile(jnp.arange(E, dtype=jnp.int32), (T, 1))
    elif kind == "k1":
        K = 1
        ids = ids[:, :1]
    elif kind == "masked":
        mask = jax.random.bernoulli(fresh_key(), p_mask, (T,))
    elif kind == "all_masked":
        mask = jnp.zeros((T,), bool)
    return ids, K, mask


# (T, H, F, E, K, Fs): small odd shapes for the float64 judge
SMALL = [(1, 64, 64, 1, 1, 0), (77, 128, 192, 8, 2, 0), (300, 256, 128, 16, 16, 64),
         (1000, 128, 256, 64, 6, 0), (129, 192, 320, 5, 5, 128)]


@pytest.mark.parametrize("case", SMALL, ids=[str(c) for c in SMALL])
def test_cuda_forward_small_vs_float64(case):
    T, H, F, E, K, Fs = case
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, Fs)
    aux = mok_jax.route(x, router, top_k=K)
    y = _cuda(x, aux.topk_ids, aux.topk_weights, wg, wu, wd, shared)
    want = npref.experts(np.asarray(x.astype(jnp.float32)), np.asarray(aux.topk_ids),
                         np.asarray(aux.topk_weights), np.asarray(wg.astype(jnp.float32)),
                         np.asarray(wu.astype(jnp.float32)), np.asarray(wd.astype(jnp.float32)),
                         None if shared is None else [np.asarray(a.astype(jnp.float32))
                                                      for a in shared])
    assert_close("y", y, want, BF16)


# The benchmark shapes at reduced T (T not a multiple of the 128-row tile).
BENCH = [(2047, 2048, 768, 128, 8), (1031, 4096, 1024, 128, 8), (513, 7168, 2048, 32, 8),
         (1029, 4096, 14336, 8, 2)]


@pytest.mark.parametrize("case", BENCH, ids=[str(c) for c in BENCH])
def test_cuda_forward_benchmark_shapes(case):
    T, H, F, E, K = case
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E, BF16)
    aux = mok_jax.route(x, router, top_k=K)
    y = _cuda(x, aux.topk_ids, aux.topk_weights, wg, wu, wd)
    want = _f32_reference(x, aux.topk_ids, aux.topk_weights, wg, wu, wd)
    assert_close("y", y, np.asarray(want, np.float64), BF16)
    y2 = _cuda(x, aux.topk_ids, aux.topk_weights, wg, wu, wd)
    np.testing.assert_array_equal(np.asarray(y.view(jnp.uint16)), np.asarray(y2.view(jnp.uint16)))


@pytest.mark.parametrize("kind", ["one_expert", "empty_experts", "k_equals_e", "masked", "shared"])
def test_cuda_forward_edge_cases(kind):
    T, H, F, E, K = 1500, 256, 384, 16, 4
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, 128)
    ids, K, mask = _edge_routing(kind, T, E, K)
    if kind != "shared":
        shared = None
    w = jax.random.uniform(fresh_key(), (T, K))
    y = _cuda(x, ids, w, wg, wu, wd, shared, mask)
    want = _f32_reference(x, ids, w, wg, wu, wd, shared, mask)
    assert_close("y", y, np.asarray(want, np.float64), BF16)
    if mask is not None:
        assert np.all(np.asarray(y.astype(jnp.float32))[~np.asarray(mask)] == 0)


@pytest.mark.parametrize("case", [(1029, 256, 392, 16, 4, 128), (2047, 2048, 768, 128, 8, 0)],
                         ids=["shared_masked", "qwen_slice"])
def test_cuda_inference_forward_equals_the_training_forward(case, monkeypatch):
    """Not differentiated (with CUDA_DROPS_RESIDUALS, forced on here), the
    forward writes no gate/up pre-activations (the act-only gate/up epilogue,
    also the shared expert's); its y is bitwise the y of the differentiated
    forward, which keeps them."""
    monkeypatch.setattr(_ffi, "CUDA_DROPS_RESIDUALS", True)
    T, H, F, E, K, Fs = case
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, Fs)
    aux = mok_jax.route(x, router, top_k=K)
    mask = jax.random.bernoulli(fresh_key(), 0.8, (T,)) if Fs else None
    f = lambda x, w, wg, wu, wd: mok_jax.experts(x, aux.topk_ids, w, wg, wu, wd, shared_experts=shared,
                                                 token_mask=mask, implementation="cuda")
    args = (x, aux.topk_weights, wg, wu, wd)
    y_inference = jax.jit(f)(*args)
    def train(*a):  # y and its gradients: the residuals are used, so they are kept
        y, vjp = jax.vjp(f, *a)
        return y, vjp(jnp.ones_like(y))
    y_train = jax.jit(train)(*args)[0]
    np.testing.assert_array_equal(np.asarray(y_inference.view(jnp.uint16)),
                                  np.asarray(y_train.view(jnp.uint16)))
    want = _f32_reference(x, aux.topk_ids, aux.topk_weights, wg, wu, wd, shared, mask)
    assert_close("y", y_inference, np.asarray(want, np.float64), BF16)


def test_cuda_layer_gradients_match_xla():
    x, router, wg, wu, wd, _ = make_problem(1000, 256, 384, 16, BF16)

    def loss(impl):
        f = lambda *a: jnp.sum(mok_jax.moe_layer(*a, top_k=4, implementation=impl)[0]
                               .astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(x, router, wg, wu, wd)

    for g, r in zip(loss("cuda"), loss("xla")):
        assert_close("grad", g, np.asarray(r.astype(jnp.float32), np.float64), BF16)


def test_auto_picks_cuda_for_bf16():
    x, router, wg, wu, wd, _ = make_problem(64, 64, 64, 4, BF16)
    hlo = jax.jit(lambda *a: mok_jax.moe_layer(*a, top_k=2)[0]).lower(
        x, router, wg, wu, wd).as_text()
    assert "mok_experts_fwd_cuda" in hlo


# ---------------------------------------------------------------- CUDA backward
def _grad_fn(impl, mask):
    def loss(x, w, wg, wu, wd, sh, ids, cot):
        y = mok_jax.experts(x, ids, w, wg, wu, wd, shared_experts=sh, token_mask=mask,
                            implementation=impl)
        return jnp.sum(y.astype(jnp.float32) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def _check_cuda_grads(x, ids, w, wg, wu, wd, shared=None, mask=None):
    """Gradients of <y, cot> through the CUDA backward against JAX's VJP of the
    float32 XLA reference on upcast inputs; bitwise reproducible across runs."""
    assert "mok_experts_bwd_cuda" in _ffi._mok_cuda.registrations()
    T, H = x.shape
    cot = jax.random.normal(fresh_key(), (T, H), jnp.float32)
    fn = _grad_fn("cuda", mask)
    got = fn(x, w, wg, wu, wd, shared, ids, cot)
    got2 = fn(x, w, wg, wu, wd, shared, ids, cot)
    up = lambda a: a.astype(jnp.float32)
    sh32 = None if shared is None else tuple(map(up, shared))
    want = _grad_fn("xla", mask)(up(x), w, up(wg), up(wu), up(wd), sh32, ids, cot)
    names = ["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"]
    pairs = list(zip(names, got[:5], got2[:5], want[:5]))
    if shared is not None:
        pairs += list(zip(["dws_gate", "dws_up", "dws_down"], got[5], got2[5], want[5]))
    for name, g, g2, r in pairs:
        assert g.dtype == (jnp.float32 if name == "d_topk_weights" else BF16), name
        assert_close_on_device(name, g, r, BF16)
        assert bitwise_equal(g, g2), f"{name}: not bitwise reproducible"
    return got


@pytest.mark.parametrize("case", BENCH, ids=[str(c) for c in BENCH])
def test_cuda_backward_benchmark_shapes(case):
    T, H, F, E, K = case
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E, BF16)
    aux = mok_jax.route(x, router, top_k=K)
    _check_cuda_grads(x, aux.topk_ids, aux.topk_weights, wg, wu, wd)


@pytest.mark.parametrize("kind", ["one_expert", "empty_experts", "k_equals_e", "masked", "shared", "k1"])
def test_cuda_backward_edge_cases(kind):
    T, H, F, E, K = 1500, 256, 384, 16, 4
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, 128)
    ids, K, mask = _edge_routing(kind, T, E, K)
    if kind not in ("shared", "masked"):
        shared = None
    w = jax.random.uniform(fresh_key(), (T, K))
    dx, dw, dwg, dwu, dwd, _ = _check_cuda_grads(x, ids, w, wg, wu, wd, shared, mask)
    if kind == "empty_experts":
        for g in (dwg, dwu, dwd):
            assert np.all(np.asarray(g[3:].astype(jnp.float32)) == 0)
    if mask is not None:
        m = ~np.asarray(mask)
        assert np.all(np.asarray(dx.astype(jnp.float32))[m] == 0)
        assert np.all(np.asarray(dw)[m] == 0)


def test_cuda_backward_is_the_ffi_target():
    x, router, wg, wu, wd, _ = make_problem(64, 64, 64, 4, BF16)
    aux = mok_jax.route(x, router, top_k=2)
    f = lambda x, w: jnp.sum(mok_jax.experts(x, aux.topk_ids, w, wg, wu, wd,
                                             implementation="cuda").astype(jnp.float32))
    hlo = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, aux.topk_weights).as_text()
    assert "mok_experts_bwd_cuda" in hlo


# ---------------------------------------------------------------- megakernel
def _cuda_cfg(cfg, x, ids, w, wg, wu, wd, shared=None, mask=None):
    return jax.jit(lambda *a: mok_jax.experts(*a, shared_experts=shared, token_mask=mask,
                                              implementation="cuda", megakernel=cfg))(
        x, ids, w, wg, wu, wd)


STAGED = mok_jax.MegakernelConfig(persistent=False)
# Knob settings that change the schedule: a ring far smaller than the routed
# rows (every slot is reused many times: macrobatches), one dispatch CTA,
# many dispatch CTAs, wide minibatches.
MEGA = mok_jax.MegakernelConfig(persistent=True)
KNOBS = [mok_jax.MegakernelConfig(persistent=True, ring_rows=256, minibatch_rows=128,
                                  dispatch_ctas=1),
         mok_jax.MegakernelConfig(persistent=True, ring_rows=1024, minibatch_rows=512,
                                  dispatch_ctas=64),
         mok_jax.MegakernelConfig(persistent=True, dispatch_ctas=3, minibatch_rows=256)]


@pytest.mark.parametrize("case", BENCH[:2] + SMALL[1:3], ids=[str(c) for c in BENCH[:2] + SMALL[1:3]])
def test_megakernel_equals_staged_bitwise(case):
    """The persistent megakernel and the staged kernels run the same tile math:
    y must be bitwise identical, for the default knobs and schedule-changing ones,
    and within tolerance of the float32 reference."""
    T, H, F, E, K = case[:5]
    Fs = case[5] if len(case) > 5 else 0
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, Fs)
    aux = mok_jax.route(x, router, top_k=K)
    args = (x, aux.topk_ids, aux.topk_weights, wg, wu, wd, shared)
    want = np.asarray(_cuda_cfg(STAGED, *args))
    for cfg in [MEGA] + KNOBS:
        got = np.asarray(_cuda_cfg(cfg, *args))
        assert got.tobytes() == want.tobytes(), f"megakernel {cfg} differs from the staged path"
    ref = _f32_reference(*args)
    assert_close("y", want, np.asarray(ref, np.float64), BF16)


@pytest.mark.parametrize("kind", ["one_expert", "empty_experts", "k_equals_e", "masked", "all_masked"])
def test_megakernel_edge_cases_tiny_ring(kind):
    """Imbalance, empty experts, k = E and masks with a 128-row ring (every
    minibatch reuses the same slot) against the float64 reference."""
    T, H, F, E, K = 700, 256, 384, 16, 4
    x, router, wg, wu, wd, _ = make_problem(T, H, F, E, BF16)
    ids, K, mask = _edge_routing(kind, T, E, K, one_expert=5, experts_used=2, p_mask=0.4)
    w = jax.random.uniform(fresh_key(), (T, K))
    cfg = mok_jax.MegakernelConfig(persistent=True, ring_rows=128, minibatch_rows=128,
                                   dispatch_ctas=2)
    y = _cuda_cfg(cfg, x, ids, w, wg, wu, wd, mask=mask)
    y2 = _cuda_cfg(cfg, x, ids, w, wg, wu, wd, mask=mask)
    assert np.asarray(y).tobytes() == np.asarray(y2).tobytes()
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    m = None if mask is None else np.asarray(mask)
    want = npref.experts(f32(x), np.asarray(ids), np.asarray(w), f32(wg), f32(wu), f32(wd), None, m)
    if kind == "all_masked":
        assert np.all(f32(y) == 0)
    else:
        assert_close("y", y, want, BF16)


# ---------------------------------------------------------------- backward megakernel
def _grads_cfg(cfg, x, ids, w, wg, wu, wd, shared, mask, cot):
    def loss(x, w, wg, wu, wd, sh):
        y = mok_jax.experts(x, ids, w, wg, wu, wd, shared_experts=sh, token_mask=mask,
                            implementation="cuda", megakernel=cfg)
        return jnp.sum(y.astype(jnp.float32) * cot)
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))(x, w, wg, wu, wd, shared)
    return [np.asarray(a) for a in jax.tree.leaves(g)]


BWD_MEGA = mok_jax.MegakernelConfig(persistent_backward=True)


def _check_backward_megakernel(x, ids, w, wg, wu, wd, shared=None, mask=None):
    """The backward megakernel claims the staged kernels' tiles in ticket order
    and computes each with the same instructions and reduction order, so every
    gradient must be bitwise the staged one (which the tests above check
    against the float32 reference), and reproducible."""
    cot = jax.random.normal(fresh_key(), x.shape, jnp.float32)
    args = (x, ids, w, wg, wu, wd, shared, mask, cot)
    want = _grads_cfg(None, *args)
    got = _grads_cfg(BWD_MEGA, *args)
    got2 = _grads_cfg(BWD_MEGA, *args)
    assert len(got) == len(want) == (8 if shared is not None else 5)
    for i, (g, g2, r) in enumerate(zip(got, got2, want)):
        assert g.dtype == r.dtype and g.shape == r.shape, i
        assert g.tobytes() == r.tobytes(), f"gradient {i}: backward megakernel differs from staged"
        assert g.tobytes() == g2.tobytes(), f"gradient {i}: not reproducible"
    return got


@pytest.mark.parametrize("case", BENCH[:2] + SMALL[1:3], ids=[str(c) for c in BENCH[:2] + SMALL[1:3]])
def test_backward_megakernel_equals_staged_bitwise(case):
    T, H, F, E, K = case[:5]
    Fs = case[5] if len(case) > 5 else 0
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, Fs)
    aux = mok_jax.route(x, router, top_k=K)
    _check_backward_megakernel(x, aux.topk_ids, aux.topk_weights, wg, wu, wd, shared)


@pytest.mark.parametrize("kind", ["one_expert", "empty_experts", "k_equals_e", "masked", "shared", "k1",
                                  "all_masked"])
def test_backward_megakernel_edge_cases(kind):
    T, H, F, E, K = 1500, 256, 384, 16, 4
    x, router, wg, wu, wd, shared = make_problem(T, H, F, E, BF16, 128)
    ids, K, mask = _edge_routing(kind, T, E, K)
    if kind not in ("shared", "masked"):
        shared = None
    w = jax.random.uniform(fresh_key(), (T, K))
    g = _check_backward_megakernel(x, ids, w, wg, wu, wd, shared, mask)
    if kind == "empty_experts":  # experts 3.. get no token: exact zero weight gradients
        for d in g[2:5]:
            assert np.all(d[3:].astype(np.float32) == 0)
    if kind == "all_masked":
        assert all(np.all(d.astype(np.float32) == 0) for d in g)


_GRAPH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import mok_jax
x = jax.random.normal(jax.random.key(1), (1000, 256), jnp.float32).astype(jnp.bfloat16)
r = jax.random.normal(jax.random.key(2), (256, 16), jnp.float32)
wg, wu = [jax.random.normal(jax.random.key(i), (16, 256, 384), jnp.float32).astype(jnp.bfloat16) * 0.05
          for i in (3, 4)]
wd = jax.random.normal(jax.random.key(5), (16, 384, 256), jnp.float32).astype(jnp.bfloat16) * 0.05
saved, same = {}, True
# The staged default and the persistent megakernel, each in its own executable
# (so a mismatch names its path).
for path, cfg in (("staged", None),
                  ("megakernel", mok_jax.MegakernelConfig(persistent=True, persistent_backward=True))):
    def loss(x, wg, wu, wd):
        y, _ = mok_jax.moe_layer(x, r, wg, wu, wd, top_k=4, implementation="cuda", megakernel=cfg)
        return jnp.sum(y.astype(jnp.float32) ** 2)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    outs = [f(x, wg, wu, wd) for _ in range(3)]   # replays
    parts = lambda o: dict(zip(("loss", "dx", "dw_gate", "dw_up", "dw_down"),
                               [np.asarray(o[0], np.float32)] +
                               [np.asarray(g.astype(jnp.float32)) for g in o[1]]))
    last = parts(outs[-1])
    saved.update({f"{path}_{k}": v for k, v in last.items()})
    same = same and all(np.array_equal(parts(o)[k], last[k]) for o in outs for k in last)
np.savez(sys.argv[1], **saved)
from mok_jax import _ffi
# Handler calls made while XLA captured the stream into a CUDA graph (newer
# XLA forms command buffers from thunks, after the HLO, so the HLO text can't
# tell).
print(json.dumps({"captured": int(_ffi._mok_cuda.captured_calls()), "replays_equal": bool(same)}))
"""


def test_handlers_run_inside_cuda_graphs(tmp_path):
    """Both handlers are marked command-buffer compatible: with custom calls in
    XLA's command buffers the forward+backward of both CUDA paths is captured
    into CUDA graphs and replayed, and gives the same values as without graphs."""
    import json
    import os
    import subprocess
    import sys
    script = tmp_path / "graph.py"
    script.write_text(_GRAPH_SCRIPT)
    res = {}
    for name, flags in [("graph", "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
                                  "--xla_gpu_graph_min_graph_size=1"),
                        ("nograph", "--xla_gpu_enable_command_buffer=")]:
        env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        out = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.npz")],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
    # Both forwards and both backwards were captured into a graph at least once.
    assert res["graph"]["captured"] >= 4, res
    assert res["nograph"]["captured"] == 0, res
    assert res["graph"]["replays_equal"]
    a, b = np.load(tmp_path / "graph.npz"), np.load(tmp_path / "nograph.npz")
    assert sorted(a.files) == sorted(b.files)
    diffs = {k: (int(np.sum(a[k] != b[k])), a[k].size, float(np.max(np.abs(a[k] - b[k]))))
             for k in a.files if not np.array_equal(a[k], b[k])}
    assert not diffs, f"graph vs no graph (differing elements, size, max |diff|): {diffs}"


def test_cuda_and_xla_train_the_same_loss_curve():
    """A short bf16 training run of examples/train_moe_lm.py (a reduced GPU
    config) through implementation="cuda" and through the pure-JAX "xla" path:
    the loss curves agree within bf16 noise (window means of 25 steps within
    0.05 nats) while the loss falls by more than 1."""
    import io
    ex = load_train_example()
    steps, window = 200, 25
    common = ["--config", "gpu", "--layers", "2", "--d-model", "512", "--heads", "8",
              "--experts", "16", "--top-k", "4", "--ffn", "512", "--seq", "256", "--batch", "16",
              "--steps", str(steps), "--log-every", str(steps), "--eval-every", "100000"]
    runs = {impl: ex.main(common + ["--implementation", impl], out=io.StringIO())
            for impl in ("cuda", "xla")}
    gap = curve_gap(runs["cuda"], runs["xla"], steps, window)
    assert gap < 0.05, gap
    losses = np.array([runs["cuda"]["losses"][s] for s in range(steps)])
    assert losses[-window:].mean() < losses[:window].mean() - 1.0, losses
