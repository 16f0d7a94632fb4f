"""Helpers of the benchmark script (`run.py`): the issue-3 shapes, timing,
weight generation, the dense-matmul ceiling, the torch ``_grouped_mm`` peer
and the memory of a training step.

Useful FLOPs: 6*T*k*H*F per forward (three GEMMs of 2*T*k*H*F), the backward
2x that, forward+backward 3x.
"""

from __future__ import annotations

import os
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {
    1: ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8),
    2: ("sonic-4096", 32768, 4096, 1024, 128, 8),
    3: ("dsv3-ep8-slice", 4096, 7168, 2048, 32, 8),
    4: ("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
}
HERE = os.path.dirname(os.path.abspath(__file__))

#: Useful-FLOP multiple of one forward, per pass.
PASS_FLOP_FACTOR = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}


def useful_flops(T, H, F, K, pass_="fwd"):
    """6*T*k*H*F for the forward, x2 for the backward, x3 for forward+backward."""
    return 6 * T * K * H * F * PASS_FLOP_FACTOR[pass_]


def median_ms(fn, warmup, iters, pipeline=1):
    """Median wall-clock ms per call of a JAX callable, blocking on its result.

    pipeline = 1: each timed sample is one call, then a block (the per-call
    latency, with the host's dispatch and the wake-up of the block exposed).
    pipeline = n > 1: a sample is n calls dispatched back to back, blocked on
    the last, divided by n (the steady state of a training loop, where JAX's
    asynchronous dispatch hides the host behind the device)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(pipeline):
            out = fn()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / pipeline)
    return 1e3 * float(np.median(ts))


def jax_peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def weights(T, H, F, E, dtype=jnp.bfloat16, seed=0):
    """x[T,H], a float32 router[H,E] and expert weights, scaled so y is O(1)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(dtype)
    router = jax.random.normal(ks[1], (H, E), jnp.float32) / np.sqrt(H)
    wg = (jax.random.normal(ks[2], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wu = (jax.random.normal(ks[3], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wd = (jax.random.normal(ks[4], (E, F, H)) / np.sqrt(F)).astype(dtype)
    return x, router, wg, wu, wd


def bench_dense_jax(warmup, iters, n=8192, dtype=jnp.bfloat16, pipeline=1):
    """TFLOP/s of a dense n^3 matmul through JAX (the ceiling)."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: a @ b)
    ms = median_ms(lambda: f(a, b), warmup, iters, pipeline)
    return 2 * n ** 3 / ms / 1e9


def torch_available():
    """torch with a CUDA device (the `_grouped_mm` peer needs one)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available()) and hasattr(torch, "_grouped_mm")


def torch_problem(data):
    """The JAX problem (x, ids, w, wg, wu, wd) as torch tensors on the same device
    buffers, no host round trip (JAX arrays speak DLPack)."""
    import torch
    x, ids, w, wg, wu, wd = (torch.from_dlpack(a) for a in data)
    return x, ids.long(), w, wg, wu, wd


def torch_moe_forward(x, ids, w, wg, wu, wd):
    """torch._grouped_mm MoE forward with the given routing (gather/scatter included)."""
    import torch
    T, K = ids.shape
    E = wg.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // K]
    g = torch._grouped_mm(xs, wg, offs=offs)
    u = torch._grouped_mm(xs, wu, offs=offs)
    a = torch.nn.functional.silu(g) * u
    o = torch._grouped_mm(a, wd, offs=offs)
    out = torch.empty_like(o)
    out[order] = o
    return (out.view(T, K, -1).float() * w.view(T, K, 1)).sum(1).to(torch.bfloat16)


def torch_timed(fn, warmup, iters, pipeline=1):
    """Median ms of fn() with CUDA events; pipeline > 1: n calls between the
    events, divided by n (as median_ms)."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(pipeline):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / pipeline)
    return float(np.median(ts))


def torch_dense_tflops(warmup, iters, n=8192, pipeline=1):
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / torch_timed(lambda: a @ b, warmup, iters, pipeline) / 1e9


def git_commit():
    """MOK_JAX_COMMIT when set (a copy of the tree on a GPU host, whose .git may
    be stale or absent), else the checkout's short commit."""
    if os.environ.get("MOK_JAX_COMMIT"):
        return os.environ["MOK_JAX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


# ------------------------------------------------------------ memory of a training step
def jax_residual_bytes(f, args):
    """Bytes the forward of f keeps for its backward, beyond f's own inputs: the
    leaves of jax.vjp's closure, minus any leaf with an input's shape and dtype
    (the inputs themselves, which a training step holds anyway)."""
    _, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(*args)
    sigs = [(tuple(a.shape), a.dtype) for a in args]
    total = 0
    for leaf in jax.tree_util.tree_leaves(vjp):
        sig = (tuple(leaf.shape), leaf.dtype)
        if sig in sigs:
            sigs.remove(sig)
            continue
        total += leaf.size * leaf.dtype.itemsize
    return int(total)


def jax_step_peak_bytes(step, args):
    """Peak device bytes one compiled call of step(*args) needs beyond its
    arguments (outputs + XLA temporaries, from the executable's memory analysis)."""
    ma = jax.jit(step).lower(*args).compile().memory_analysis()
    if ma is None:
        return None
    return int(ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes)


def torch_saved_bytes(fwd, leaves):
    """Bytes autograd saves for the backward of fwd() beyond the leaf tensors
    (distinct storages seen by saved_tensors_hooks)."""
    import torch
    skip = {t.untyped_storage().data_ptr() for t in leaves}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fwd()
    del y
    return int(sum(seen.values()))


def torch_step_peak_bytes(step):
    """Peak bytes torch's allocator holds during step() beyond what it held before
    (the inputs live in JAX's allocator and are not counted on either side)."""
    import torch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)
