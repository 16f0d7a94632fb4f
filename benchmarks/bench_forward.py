"""Forward benchmark of the MoE layer on one GPU, with its peers in the same run.

For each shape (T, H, F, E, k), bf16, random router: times mok_jax's CUDA
forward (`experts`, the megakernel's level, routing precomputed), the
project's own "xla" path (jax.lax.ragged_dot), and torch._grouped_mm with the
same routing when torch is importable; plus a dense bf16 8192^3 matmul (the
ceiling) through JAX and torch. Reports useful TFLOP/s (6*T*k*H*F), ms
(median of --iters after --warmup) and peak device memory; writes JSON and
appends rows to benchmarks/RESULTS.md.

    python benchmarks/bench_forward.py [--shapes 1,2,3,4] [--iters 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import argparse
import datetime
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax

SHAPES = {
    1: ("qwen3-30b-a3b", 32768, 2048, 768, 128, 8),
    2: ("sonic-4096", 32768, 4096, 1024, 128, 8),
    3: ("dsv3-ep8-slice", 4096, 7168, 2048, 32, 8),
    4: ("mixtral-8x7b", 8192, 4096, 14336, 8, 2),
}
HERE = os.path.dirname(os.path.abspath(__file__))


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def jax_peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def problem(T, H, F, E, K, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    bf = jnp.bfloat16
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(bf)
    router = jax.random.normal(ks[1], (H, E), jnp.float32) / np.sqrt(H)
    wg = (jax.random.normal(ks[2], (E, H, F)) / np.sqrt(H)).astype(bf)
    wu = (jax.random.normal(ks[3], (E, H, F)) / np.sqrt(H)).astype(bf)
    wd = (jax.random.normal(ks[4], (E, F, H)) / np.sqrt(F)).astype(bf)
    aux = jax.jit(lambda x, r: mok_jax.route(x, r, top_k=K))(x, router)
    return x, aux.topk_ids, aux.topk_weights, wg, wu, wd


def bench_jax(impl, data, warmup, iters):
    f = jax.jit(lambda *a: mok_jax.experts(*a, implementation=impl))
    run = lambda: jax.block_until_ready(f(*data))
    y = run()
    return median_ms(run, warmup, iters), y


def bench_dense_jax(warmup, iters, n=8192):
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    ms = median_ms(lambda: jax.block_until_ready(f(a, b)), warmup, iters)
    return 2 * n ** 3 / ms / 1e9


def torch_peers(data, warmup, iters):
    """torch._grouped_mm forward with the same routing, and the dense ceiling."""
    try:
        import torch
    except ImportError:
        return None
    dev = "cuda"
    # Same device buffers, no host round trip (JAX arrays speak DLPack).
    x, ids, w, wg, wu, wd = (torch.from_dlpack(a) for a in data)
    ids = ids.long()
    T, K = ids.shape
    E = wg.shape[0]

    def forward():
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

    def timed(fn):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        return float(np.median(ts))

    torch.cuda.reset_peak_memory_stats()
    y = forward()
    ms = timed(forward)
    peak = torch.cuda.max_memory_allocated()
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dense = 2 * n ** 3 / timed(lambda: a @ b) / 1e9
    return {"ms": ms, "peak_bytes": peak, "dense_tflops": dense,
            "y": y.float().cpu().numpy(), "version": torch.__version__}


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       text=True).strip()
    except Exception:
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="1,2,3,4")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--xla-iters", type=int, default=3, help="the ragged_dot path is slow")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--json", default=os.path.join(HERE, "results", "forward_latest.json"))
    p.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args()

    dev = jax.devices()[0]
    dense_jax = bench_dense_jax(args.warmup, args.iters)
    rows = []
    for sid in [int(s) for s in args.shapes.split(",")]:
        name, T, H, F, E, K = SHAPES[sid]
        flops = 6 * T * K * H * F
        data = problem(T, H, F, E, K)
        ms, y = bench_jax("cuda", data, args.warmup, args.iters)
        row = {"shape": sid, "name": name, "T": T, "H": H, "F": F, "E": E, "k": K,
               "mok_ms": ms, "mok_tflops": flops / ms / 1e9, "mok_peak_bytes": jax_peak_bytes()}
        if not args.no_xla:
            xms, yx = bench_jax("xla", data, 1, args.xla_iters)
            row.update(xla_ms=xms, xla_tflops=flops / xms / 1e9,
                       rel_l2_vs_xla=float(np.linalg.norm(np.asarray(y, np.float32) - np.asarray(yx, np.float32))
                                           / np.linalg.norm(np.asarray(yx, np.float32))))
        tp = torch_peers(data, args.warmup, args.iters)
        if tp is not None:
            row.update(torch_ms=tp["ms"], torch_tflops=flops / tp["ms"] / 1e9,
                       torch_peak_bytes=tp["peak_bytes"], torch_dense_tflops=tp["dense_tflops"],
                       rel_l2_vs_torch=float(np.linalg.norm(np.asarray(y, np.float32) - tp["y"])
                                             / np.linalg.norm(tp["y"])))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}), flush=True)
        del data, y

    meta = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "device": str(dev),
            "device_kind": dev.device_kind, "jax": jax.__version__, "dense_jax_tflops": dense_jax,
            "command": "python " + " ".join(sys.argv)}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)

    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"
    lines = []
    for r in rows:
        lines.append(
            f"| {meta['date']} | {meta['commit']} | {meta['device_kind']} | fwd | {r['name']} "
            f"({r['T']},{r['H']},{r['F']},{r['E']},{r['k']}) | {fmt(r['mok_ms'], 2)} | "
            f"{fmt(r['mok_tflops'])} | {fmt(r.get('torch_tflops'))} | {fmt(r.get('xla_tflops'))} | "
            f"{fmt(dense_jax)} / {fmt(r.get('torch_dense_tflops'))} | "
            f"{fmt((r['mok_peak_bytes'] or 0) / 2**30, 2)} / {fmt((r.get('torch_peak_bytes') or 0) / 2**30, 2)} | "
            f"`{meta['command']}` |")
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n".join(lines) + "\n")
    print("\n| shape | mok ms | mok TF/s | torch TF/s | xla TF/s | dense jax/torch |")
    for r in rows:
        print(f"| {r['name']} | {fmt(r['mok_ms'], 2)} | {fmt(r['mok_tflops'])} | "
              f"{fmt(r.get('torch_tflops'))} | {fmt(r.get('xla_tflops'))} | "
              f"{fmt(dense_jax)}/{fmt(r.get('torch_dense_tflops'))} |")


if __name__ == "__main__":
    main()
