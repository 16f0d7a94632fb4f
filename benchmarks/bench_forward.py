"""Forward benchmark of the MoE layer on one GPU, with its peers in the same run.

For each shape (T, H, F, E, k), bf16, random router: times mok_jax's CUDA
forward (`experts`, the megakernel's level, routing precomputed), the
project's own "xla" path (the pure-JAX reference), and torch._grouped_mm with the
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
import sys

import jax
import numpy as np

try:  # python -m benchmarks.bench_forward
    from .common import (HERE, SHAPES, bench_dense_jax, bench_jax, git_commit,  # noqa: F401
                         jax_peak_bytes, median_ms, problem, torch_peers)
except ImportError:  # python benchmarks/bench_forward.py
    from common import (HERE, SHAPES, bench_dense_jax, bench_jax, git_commit,  # noqa: F401
                        jax_peak_bytes, median_ms, problem, torch_peers)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="1,2,3,4")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--xla-iters", type=int, default=3, help="the pure-JAX path is slow")
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
            try:
                xms, yx = bench_jax("xla", data, 1, args.xla_iters)
            except jax.errors.JaxRuntimeError as err:  # a peer failing is a result, not a crash
                row["xla_error"] = str(err).split(":")[0]
            else:
                row.update(xla_ms=xms, xla_tflops=flops / xms / 1e9,
                           rel_l2_vs_xla=rel_l2(y, yx))
        tp = torch_peers(data, args.warmup, args.iters)
        if tp is not None:
            row.update(torch_ms=tp["ms"], torch_tflops=flops / tp["ms"] / 1e9,
                       torch_peak_bytes=tp["peak_bytes"], torch_dense_tflops=tp["dense_tflops"],
                       rel_l2_vs_torch=rel_l2(y, tp["y"]))
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
