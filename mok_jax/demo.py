"""`python -m mok_jax.demo`: one forward+backward of a realistic MoE layer on
the default device, checked against the pure-JAX reference, with its time and
useful TFLOP/s (6*T*k*H*F per forward, x3 for forward+backward)."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax
from mok_jax.experts import resolve_implementation

# (T, H, F, E, k) per backend: a CPU-sized layer, and Qwen3-30B-A3B's MoE layer (at T=8192:
# the pure-JAX reference it is checked against is slow on GPUs).
DEFAULTS = {"cpu": (2048, 256, 512, 16, 2), "gpu": (8192, 2048, 768, 128, 8)}


def _problem(T, H, F, E, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(dtype)
    router = jax.random.normal(ks[1], (H, E), jnp.float32) / np.sqrt(H)
    wg = (jax.random.normal(ks[2], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wu = (jax.random.normal(ks[3], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wd = (jax.random.normal(ks[4], (E, F, H)) / np.sqrt(F)).astype(dtype)
    probe = jax.random.normal(ks[5], (T, H), jnp.float32)
    return x, router, wg, wu, wd, probe


def _step(impl, top_k):
    def loss(x, router, wg, wu, wd, probe):
        y, aux = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=top_k, implementation=impl)
        return jnp.sum(y.astype(jnp.float32) * probe) + 0.01 * aux.load_balancing_loss
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    backend = jax.default_backend()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", type=int, nargs=5, metavar=("T", "H", "F", "E", "K"),
                   default=DEFAULTS["cpu" if backend == "cpu" else "gpu"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   default="float32" if backend == "cpu" else "bfloat16")
    p.add_argument("--implementation", default="auto")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    T, H, F, E, K = args.shape
    dtype = jnp.dtype(args.dtype)
    impl = resolve_implementation(args.implementation, dtype)
    print(f"mok_jax {mok_jax.__version__}, jax {jax.__version__}, device: {jax.devices()[0]}")
    print(f"layer T={T} H={H} F={F} E={E} k={K} {dtype.name}, implementation={impl}")

    data = _problem(T, H, F, E, dtype)
    step = _step(impl, K)
    (loss, grads) = jax.block_until_ready(step(*data))
    (loss_ref, grads_ref) = jax.block_until_ready(_step("xla", K)(*data))
    names = ["d_x", "d_router", "d_w_gate", "d_w_up", "d_w_down"]
    errs = {n: _rel(g.astype(jnp.float32), r.astype(jnp.float32))
            for n, g, r in zip(names, grads, grads_ref)}
    errs["loss"] = _rel(loss, loss_ref)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-4
    print("relative L2 error vs the xla reference: " +
          ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))

    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*data))
        times.append(time.perf_counter() - t0)
    ms = 1e3 * float(np.median(times))
    flops = 3 * 6 * T * K * H * F
    print(f"forward+backward: {ms:.2f} ms (median of {args.iters}), "
          f"{flops / ms / 1e9:.2f} TFLOP/s useful")
    bad = {n: e for n, e in errs.items() if not e <= tol}
    if bad:
        raise SystemExit(f"FAILED: errors above {tol}: {bad}")
    print("OK")


if __name__ == "__main__":
    main()
