"""GPU test of the peer-dispatch protocol (ffi/peer_forward.h) with virtual
ranks on one GPU (`pytest -m gpu` on a Hopper host with nvcc on PATH).

tests/cuda/peer_standalone.cu runs 1, 2, 4 and 8 ranks on one device, each
with its own stream, control block and buffers, and requires y bitwise equal
to the EP = 1 forward and within relative L2 1e-2 of fp64 (then the backward:
d_x and d_topk_weights bitwise the EP = 1 backward's, weight gradients
within relative L2 1e-2), under balanced,
skewed and all-to-one-rank routing, rounds beyond the buffer, masked tokens
and a shared expert; a peer that never comes must stop rank 0 with a
"lost peer" error instead of a hang.

Through JAX (mok_jax.experts_parallel / moe_layer with dispatch="peer"): the
FFI targets mok_peer_fwd_cuda / mok_peer_bwd_cuda on a mesh of this one GPU
(a peer table of one) are bitwise the EP = 1 CUDA forward and backward, call
after call; in rounds smaller than the rows (the weight gradients summed
over rounds in fp32) the forward stays bitwise and the gradients within the
bf16 tolerance; on a host with several GPUs the forward and gradients match
EP = 1 for a mesh of all of them (skipped with one GPU).
"""

import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import mok_jax
from mok_jax import _ffi, parallel
from helpers import assert_close, fresh_key, make_problem, run_worker_processes

pytestmark = pytest.mark.gpu
ROOT = os.path.join(os.path.dirname(__file__), "..")


def _gpu_available():
    if shutil.which("nvcc") is None or shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def peer_binary(tmp_path_factory):
    if not _gpu_available():
        pytest.skip("needs nvcc and an NVIDIA GPU")
    out = tmp_path_factory.mktemp("peer")
    env = dict(os.environ, OUTDIR=str(out), BUILD_ONLY="1")
    subprocess.run(["bash", os.path.join(ROOT, "tests", "cuda", "build_and_run_peer.sh")], env=env, check=True)
    return str(out / "peer_standalone")


def test_virtual_ranks_match_ep1_bitwise(peer_binary):
    run = subprocess.run([peer_binary], capture_output=True, text=True, timeout=600)
    print(run.stdout, run.stderr)
    assert run.returncode == 0 and "ALL PASS" in run.stdout
    # 6 cases x (2 forward routings + 1 backward), every one reported
    assert run.stdout.count("PASS") >= 18 and run.stdout.count(" backward ") >= 6


def test_lost_peer_is_an_error_not_a_hang(peer_binary):
    run = subprocess.run([peer_binary, "--lost-peer"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "lost peer" in run.stdout + run.stderr


def _need_jax_cuda():
    if jax.default_backend() != "gpu" or not _ffi.cuda_built() or not _ffi.cuda_device_supported():
        pytest.skip("needs an sm_90 GPU and the CUDA backend")


def _routing(kind, T, E, K):
    ids = jax.random.randint(fresh_key(), (T, K), 0, E)
    if kind == "one_rank":  # every pair to the last rank's experts (1 GPU: expert E-1 and below)
        ids = E - 1 - (jnp.arange(T * K, dtype=jnp.int32).reshape(T, K) % 2)
    mask = None
    if kind == "masked":
        mask = jax.random.uniform(fresh_key(), (T,)) > 0.3
    return ids, mask


# (T, H, F, E, K, Fs, routing): T not a multiple of 128, imbalance, masked
# tokens, a shared expert, rounds of the default size.
JAX_CASES = [(1000, 256, 128, 16, 4, 0, "uniform"), (300, 512, 256, 8, 2, 128, "one_rank"),
             (515, 256, 256, 32, 8, 0, "masked"), (2048, 2048, 768, 128, 8, 0, "uniform")]


def _peer_vs_cuda(mesh, case, bitwise_grads=True):
    T, H, F, E, K, Fs, kind = case
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, dtype=jnp.bfloat16, shared_ffn=Fs)
    ids, mask = _routing(kind, T, E, K)
    w = jax.random.uniform(fresh_key(), (T, K), minval=0.1)
    ct = jax.random.normal(fresh_key(), (T, H))

    def grads(fn):
        def loss(x, w, wg, wu, wd, sh):
            y = fn(x, ids, w, wg, wu, wd, shared_experts=sh, token_mask=mask)
            return jnp.sum(y.astype(jnp.float32) * ct), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))

    peer = grads(lambda *a, **kw: parallel.experts_parallel(
        *a, **kw, mesh=mesh, expert_axis="expert", implementation="cuda", dispatch="peer"))
    ep1 = grads(lambda *a, **kw: mok_jax.experts(*a, **kw, implementation="cuda"))
    (_, y0), g0 = ep1(x, w, wg, wu, wd, sh)
    up = lambda a: a.astype(jnp.float32)
    ref = mok_jax.experts(up(x), ids, w, up(wg), up(wu), up(wd), token_mask=mask,
                          shared_experts=None if sh is None else tuple(map(up, sh)),
                          implementation="xla")
    for _ in range(3):  # the generation counters carry over between calls
        (_, y1), g1 = peer(x, w, wg, wu, wd, sh)
        np.testing.assert_array_equal(np.asarray(y1).view(np.uint16), np.asarray(y0).view(np.uint16))
    assert_close("peer y", y1, ref, jnp.bfloat16)
    if os.environ.get("MOK_JAX_PEER_STAGING") == "1":  # the staged path was taken
        from mok_jax import _peer_ipc
        assert _peer_ipc.active() and _peer_ipc._STAGED, _peer_ipc._STAGED
    names = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "shared")
    for name, a, b in zip(names, g1, g0):
        for la, lb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            if bitwise_grads:
                np.testing.assert_array_equal(np.asarray(la, np.float32), np.asarray(lb, np.float32),
                                              err_msg=name)
            else:
                assert_close(name, la, jnp.asarray(lb, jnp.float32), jnp.bfloat16)


@pytest.mark.parametrize("case", JAX_CASES, ids=[str(c) for c in JAX_CASES])
def test_jax_peer_one_gpu_equals_ep1_bitwise(case):
    _need_jax_cuda()
    _peer_vs_cuda(Mesh(np.array(jax.devices()[:1]), ("expert",)), case)


def test_jax_peer_rounds_smaller_than_the_rows():
    """round_rows = 128 (the FFI calls directly, one rank): many rounds, round 0
    from the forward's kept pre-activations and the others recomputed, the
    weight gradients summed over rounds in fp32; the forward bitwise, d_x and
    d_topk_weights bitwise, the weight gradients within the bf16 tolerance."""
    _need_jax_cuda()
    T, H, F, E, K, Fs = 512, 256, 256, 16, 4, 128
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, dtype=jnp.bfloat16, shared_ffn=Fs)
    ids, _ = _routing("uniform", T, E, K)
    w = jax.random.uniform(fresh_key(), (T, K), minval=0.1)
    mask = jnp.ones((T,), jnp.uint8)
    dy = jax.random.normal(fresh_key(), (T, H)).astype(jnp.bfloat16)
    inputs = (x, ids, w, mask, wg, wu, wd, *sh)
    dev = [jax.devices()[0].local_hardware_id]
    fwd = jax.jit(lambda *a: _ffi.peer_forward_call("cuda", a, dev, 1, 20000, round_rows=128))
    bwd = jax.jit(lambda dy, kept, *a: _ffi.peer_backward_call("cuda", dy, a, kept, dev, 1, 20000,
                                                               round_rows=128))
    y0, *res = _ffi.forward_call("cuda", inputs)
    g0 = _ffi.backward_call("cuda", dy, inputs, res)
    y1, kept = fwd(*inputs)  # round 0 kept, rounds >= 1 recomputed by the backward
    assert [k.shape for k in kept] == [(128, F), (128, F)]
    np.testing.assert_array_equal(np.asarray(y1).view(np.uint16), np.asarray(y0).view(np.uint16))
    g1 = bwd(dy, kept, *inputs)
    np.testing.assert_array_equal(np.asarray(g1[0]).view(np.uint16), np.asarray(g0[0]).view(np.uint16))
    np.testing.assert_array_equal(g1[1], g0[1])  # d_topk_weights: per row, no round sums
    for name, a, b in zip(("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down"), g1[2:], g0[2:]):
        assert_close(name, a, jnp.asarray(b, jnp.float32), jnp.bfloat16)
        assert np.all(np.isfinite(np.asarray(a, np.float32)))


def test_jax_peer_layer_gradients():
    """moe_layer with dispatch="peer" under jax.grad: the layer's gradients as
    the EP=1 layer's (the router's backward runs in XLA on both)."""
    _need_jax_cuda()
    T, H, F, E, K = 512, 256, 256, 16, 4
    x, router, wg, wu, wd, sh = make_problem(T, H, F, E, dtype=jnp.bfloat16, shared_ffn=128)
    ct = jax.random.normal(fresh_key(), (T, H))
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))

    def loss(x, wg, wu, wd, **kw):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                                 implementation="cuda", **kw)
        return jnp.sum(y.astype(jnp.float32) * ct)

    g = lambda **kw: jax.jit(jax.grad(lambda *a: loss(*a, **kw), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    g0 = g()
    g1 = g(mesh=mesh, expert_axis="expert", dispatch="peer")
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), g1, g0):
        assert_close(name, a, jnp.asarray(b, jnp.float32), jnp.bfloat16)


def test_jax_peer_recompute_and_modules_with_a_mesh():
    """recompute=True with dispatch="peer" (the backward gets zero-size kept
    operands and recomputes every round): gradients bitwise those of the
    default (round 0 kept), the same GEMMs on the same rows. And the Flax nnx
    module with a mesh and dispatch="peer" matches the module without one
    (bf16 tolerance: the router runs inside shard_map there)."""
    _need_jax_cuda()
    T, H, F, E, K = 512, 256, 256, 16, 4
    x, _, wg, wu, wd, _ = make_problem(T, H, F, E, dtype=jnp.bfloat16)
    ids, _ = _routing("uniform", T, E, K)
    w = jax.random.uniform(fresh_key(), (T, K), minval=0.1)
    ct = jax.random.normal(fresh_key(), (T, H))
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))

    def grads(recompute):
        def loss(x, w, wg, wu, wd):
            y = parallel.experts_parallel(x, ids, w, wg, wu, wd, mesh=mesh, expert_axis="expert",
                                          implementation="cuda", dispatch="peer", recompute=recompute)
            return jnp.sum(y.astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w, wg, wu, wd)

    for name, a, b in zip(("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"), grads(True), grads(False)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)

    from flax import nnx
    import mok_jax.nnx as mnnx
    kw = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K, implementation="cuda",
              dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    m0 = mnnx.MoE(**kw, rngs=nnx.Rngs(0))
    m1 = mnnx.MoE(**kw, mesh=mesh, expert_axis="expert", dispatch="peer", rngs=nnx.Rngs(0))
    xs = x.reshape(4, T // 4, H)
    y0, y1 = m0(xs), m1(xs)
    y0, y1 = (y[0] if isinstance(y, tuple) else y for y in (y0, y1))
    assert_close("nnx module, peer mesh", y1, jnp.asarray(y0, jnp.float32), jnp.bfloat16)


def test_auto_dispatch_answers_on_this_gpu():
    """The real CUDA answers "auto" reads: one GPU reaches itself, a GPU that
    does not exist is a clear problem, not a crash; a one-GPU mesh (EP = 1)
    resolves "auto" to the plain local kernel."""
    _need_jax_cuda()
    mod = _ffi._mok_cuda
    assert mod.peer_access_problem([0]) == ""
    problem = mod.peer_access_problem([0, 4096])
    assert "4096" in problem, problem
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    assert parallel._resolve_dispatch("auto", "cuda", mesh, (1024, 1024, 512, 8, 4, 0, 1)) == "collective"


def test_staged_workspace_holds_no_return_rows():
    """With IPC staging the return rows (forward: T*K*H bf16; backward: those
    and the fp32 partial dots) live in the staging buffer, so the XLA
    workspace is smaller by exactly them (each region 256-byte aligned)."""
    _need_jax_cuda()
    mod = _ffi._mok_cuda
    T, H, F, E, K, Fs, ranks = 1000, 1024, 512, 16, 4, 0, 2
    dims = (T, H, F, E, K, Fs, ranks, 0)
    fwd = mod.peer_forward_workspace_bytes(*dims, False) - mod.peer_forward_workspace_bytes(*dims, True)
    bwd = mod.peer_backward_workspace_bytes(*dims, False) - mod.peer_backward_workspace_bytes(*dims, True)
    parts = -(-F // 256)
    assert fwd == T * K * H * 2, fwd
    assert bwd == T * K * H * 2 + T * K * parts * 4, bwd
    assert mod.peer_forward_workspace_bytes(*dims, True) > 0


def test_jax_peer_all_gpus_of_the_host():
    """Every GPU of the host as one expert group (NVLink pulls and pushes)."""
    _need_jax_cuda()
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs 2 or more GPUs (not available to this project yet)")
    n = 1 << (min(n, 8).bit_length() - 1)
    mesh = Mesh(np.array(jax.devices()[:n]), ("expert",))
    # One host's GPUs: dispatch="auto" picks the peer path (NVLink / P2P).
    assert parallel._resolve_dispatch("auto", "cuda", mesh, (1024, 1024, 512, 8 * n, 4, 0, n)) == "peer"
    for case in [(1024 * n, 1024, 512, 8 * n, 4, 0, "uniform"),
                 (256 * n, 1024, 512, 8 * n, 2, 256, "one_rank")]:
        _peer_vs_cuda(mesh, case, bitwise_grads=False)


def test_jax_peer_staged_in_one_process():
    """MOK_JAX_PEER_STAGING=1 (every peer buffer in the library's exported
    staging, as across processes, here with a table of one): the one-GPU
    cases with a shared expert and with masked tokens, bitwise EP = 1, in a
    fresh process (the switch is read once)."""
    _need_jax_cuda()
    import sys
    env = dict(os.environ, MOK_JAX_PEER_STAGING="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          os.path.abspath(__file__), "-k", "one_gpu_equals_ep1 and (one_rank or masked)"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=400)
    print(run.stdout[-3000:], run.stderr[-2000:])
    assert run.returncode == 0 and "2 passed" in run.stdout


def test_jax_peer_two_processes_over_cuda_ipc():
    """Two processes sharing this GPU form one expert group: the multi-process
    peer path (CUDA IPC staging, handles swapped through jax.distributed)
    matches EP = 1 (tests/gpu_ipc_worker.py says what is checked)."""
    _need_jax_cuda()
    worker = os.path.join(os.path.dirname(__file__), "gpu_ipc_worker.py")
    seed = int(jax.random.randint(fresh_key(), (), 0, 2**30))
    outs = run_worker_processes(worker, lambda i, port: (i, port, seed), 2, "IPC_WORKER_OK",
                                dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"), timeout=240)
    print(outs[0][-4000:])
