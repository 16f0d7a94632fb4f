"""GPU test of the peer-dispatch protocol (ffi/peer_forward.h) with virtual
ranks on one GPU (`pytest -m gpu` on a Hopper host with nvcc on PATH).

tests/cuda/peer_standalone.cu runs 1, 2, 4 and 8 ranks on one device, each
with its own stream, control block and buffers, and requires y bitwise equal
to the EP = 1 forward and within relative L2 1e-2 of fp64, under balanced,
skewed and all-to-one-rank routing, rounds beyond the buffer, masked tokens
and a shared expert; a peer that never comes must stop rank 0 with a
"lost peer" error instead of a hang.

Through JAX (mok_jax.experts_parallel / moe_layer with dispatch="peer"): the
FFI target mok_peer_fwd_cuda on a mesh of this one GPU (a peer table of
one) is bitwise the EP = 1 CUDA forward, call after call, and its
gradients (the collective backward) match; on a host with several GPUs the
same holds for a mesh of all of them (skipped with one GPU).
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
from helpers import assert_close, fresh_key, make_problem

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
    assert run.stdout.count("PASS") >= 12  # 6 cases x 2 routings, every one reported


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


def _peer_vs_cuda(mesh, case):
    T, H, F, E, K, Fs, kind = case
    x, _, wg, wu, wd, sh = make_problem(T, H, F, E, dtype=jnp.bfloat16, shared_ffn=Fs)
    ids, mask = _routing(kind, T, E, K)
    w = jax.random.uniform(fresh_key(), (T, K), minval=0.1)
    peer = jax.jit(lambda *a: parallel.experts_parallel(
        *a, mesh=mesh, expert_axis="expert", shared_experts=sh, token_mask=mask,
        implementation="cuda", dispatch="peer"))
    ep1 = jax.jit(lambda *a: mok_jax.experts(*a, shared_experts=sh, token_mask=mask,
                                             implementation="cuda"))
    y0 = np.asarray(ep1(x, ids, w, wg, wu, wd))
    up = lambda a: a.astype(jnp.float32)
    ref = mok_jax.experts(up(x), ids, w, up(wg), up(wu), up(wd), token_mask=mask,
                          shared_experts=None if sh is None else tuple(map(up, sh)),
                          implementation="xla")
    for _ in range(3):  # the generation counters carry over between calls
        y1 = np.asarray(peer(x, ids, w, wg, wu, wd))
        np.testing.assert_array_equal(y1.view(np.uint16), y0.view(np.uint16))
    assert_close("peer y", y1, ref, jnp.bfloat16)


@pytest.mark.parametrize("case", JAX_CASES, ids=[str(c) for c in JAX_CASES])
def test_jax_peer_one_gpu_equals_ep1_bitwise(case):
    _need_jax_cuda()
    _peer_vs_cuda(Mesh(np.array(jax.devices()[:1]), ("expert",)), case)


def test_jax_peer_layer_gradients():
    """moe_layer with dispatch="peer": forward through the peer target, the
    backward through the collective rounds; gradients as the EP=1 layer's."""
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


def test_jax_peer_all_gpus_of_the_host():
    """Every GPU of the host as one expert group (NVLink pulls and pushes)."""
    _need_jax_cuda()
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs 2 or more GPUs (not available to this project yet)")
    n = 1 << (min(n, 8).bit_length() - 1)
    mesh = Mesh(np.array(jax.devices()[:n]), ("expert",))
    for case in [(1024 * n, 1024, 512, 8 * n, 4, 0, "uniform"),
                 (256 * n, 1024, 512, 8 * n, 2, 256, "one_rank")]:
        _peer_vs_cuda(mesh, case)
