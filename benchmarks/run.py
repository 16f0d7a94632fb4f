"""MoE layer benchmarks: TFLOP/s per shape, implementation and pass, plus
expert-load (imbalance) sweeps, with JSON output and PNG plots.

    python -m benchmarks.run                       # default shapes of this backend
    python benchmarks/run.py --shapes 1,2,3,4 --impls cuda,xla,torch \\
        --passes fwd,bwd,fwd+bwd --sweep uniform,zipf,all-to-one

Shapes (``--shapes``, comma-separated): an issue-3 GPU shape id (1-4, see
``common.SHAPES``), a CPU preset (``cpu-s``, ``cpu-m``), or ``TxHxFxExK``.
Implementations (``--impls``): ``cpu`` / ``cuda`` (mok_jax's FFI kernels),
``xla`` (mok_jax's pure-JAX reference), ``auto``, ``torch``
(``torch._grouped_mm`` with the same routing, GPU only, when importable),
``cuda-megakernel`` (the CUDA backend's persistent forward megakernel instead
of its default staged kernels), ``cuda-bwd-megakernel`` (staged forward, the
persistent backward megakernel), and the expert-parallel layer
(`mok_jax.experts_parallel`) over a mesh of the first ``--ep`` devices (default
1: a peer table of one): ``cuda-peer`` / ``cpu-peer`` (``dispatch="peer"``)
and ``cuda-collective`` / ``cpu-collective`` (``dispatch="collective"``),
their inputs sharded over the mesh before timing; their TFLOP/s are those of
the whole mesh.

Timed at `mok_jax.experts` level (routing precomputed, so the load can be
controlled): the main table uses a random router's routing; the sweep
(``--sweep``, on ``--sweep-shape``, default the first shape) routes tokens
uniformly at random, Zipf-skewed over experts (``--zipf-s``), or all to the
same k experts ("all-to-one": expert 0 gets every first choice).

Useful FLOPs: 6*T*k*H*F per forward (three GEMMs of 2*T*k*H*F); the backward
counts 2x that (12*T*k*H*F), forward+backward 3x (18*T*k*H*F). TFLOP/s =
useful FLOPs / median wall time. The ceiling is a dense n^3 matmul in the same
dtype (n=8192 on GPU, 1024 on CPU).

Writes ``<out>/<tag>_latest.json`` and, when matplotlib is installed,
``<out>/<tag>_tflops.png`` and ``<out>/<tag>_imbalance.png``; ``--record``
appends the main table's rows (ours beside torch and xla, per shape and pass)
to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import argparse
import datetime
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mok_jax
from mok_jax import _ffi

try:  # python -m benchmarks.run
    from .common import (HERE, SHAPES, bench_dense_jax, git_commit, jax_peak_bytes,
                         jax_residual_bytes, jax_step_peak_bytes, median_ms, torch_available,
                         torch_dense_tflops, torch_moe_forward, torch_problem, torch_saved_bytes,
                         torch_step_peak_bytes, torch_timed, useful_flops, weights)
except ImportError:  # python benchmarks/run.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import (HERE, SHAPES, bench_dense_jax, git_commit, jax_peak_bytes,
                        jax_residual_bytes, jax_step_peak_bytes, median_ms, torch_available,
                        torch_dense_tflops, torch_moe_forward, torch_problem, torch_saved_bytes,
                        torch_step_peak_bytes, torch_timed, useful_flops, weights)

CPU_SHAPES = {
    "cpu-s": ("cpu-s", 512, 128, 256, 8, 2),
    "cpu-m": ("cpu-m", 2048, 256, 512, 16, 2),
}
PASSES = ("fwd", "bwd", "fwd+bwd")
ROUTINGS = ("uniform", "zipf", "all-to-one")
EP_IMPLS = ("cuda-peer", "cuda-collective", "cpu-peer", "cpu-collective")
IMPLS = ("auto", "cpu", "cuda", "cuda-megakernel", "cuda-bwd-megakernel", *EP_IMPLS, "xla", "torch")


def experts_call(impl, ep=1):
    """f(x, ids, w, wg, wu, wd) -> y of a benchmark implementation name:
    "cuda-megakernel" is the CUDA backend with the persistent megakernel
    (MegakernelConfig(persistent=True)) instead of the default staged kernels,
    "cuda-bwd-megakernel" the staged forward with the persistent backward
    megakernel (MegakernelConfig(persistent_backward=True));
    "<kernel>-<dispatch>" the expert-parallel layer over the first ``ep`` devices."""
    if impl == "cuda-megakernel":
        kw = {"implementation": "cuda", "megakernel": mok_jax.MegakernelConfig(persistent=True)}
    elif impl == "cuda-bwd-megakernel":
        kw = {"implementation": "cuda",
              "megakernel": mok_jax.MegakernelConfig(persistent_backward=True)}
    elif impl in EP_IMPLS:
        from mok_jax import parallel
        kernel, dispatch = impl.split("-")
        mesh = ep_mesh(ep)
        return lambda *a: parallel.experts_parallel(*a, mesh=mesh, expert_axis="expert",
                                                    implementation=kernel, dispatch=dispatch)
    else:
        kw = {"implementation": impl}
    return lambda *a: mok_jax.experts(*a, **kw)


def ep_mesh(ep):
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices()[:ep]), ("expert",))


def place(impl, ep, data, probe):
    """The inputs of an expert-parallel implementation sharded over its mesh
    (tokens and experts along the expert axis), so a timed call moves no
    inputs between devices; the others' inputs as they are."""
    if impl not in EP_IMPLS:
        return data, probe
    from jax.sharding import NamedSharding, PartitionSpec as P
    rows = NamedSharding(ep_mesh(ep), P("expert"))
    return jax.device_put(data, rows), jax.device_put(probe, rows)


def parse_shapes(spec):
    """'1,cpu-s,64x32x64x4x2' -> [(name, T, H, F, E, k), ...]."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item.isdigit() and int(item) in SHAPES:
            out.append(SHAPES[int(item)])
        elif item in CPU_SHAPES:
            out.append(CPU_SHAPES[item])
        elif item.count("x") == 4:
            try:
                T, H, F, E, K = (int(v) for v in item.split("x"))
            except ValueError:
                raise SystemExit(f"--shapes: {item!r} is not TxHxFxExK with integers")
            if not 1 <= K <= E:
                raise SystemExit(f"--shapes: {item!r} needs 1 <= k <= E")
            out.append((item, T, H, F, E, K))
        else:
            raise SystemExit(f"--shapes: unknown shape {item!r}; use 1-4, "
                             f"{', '.join(CPU_SHAPES)} or TxHxFxExK")
    if not out:
        raise SystemExit("--shapes: no shape given")
    return out


def parse_list(name, spec, allowed):
    items = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"--{name}: {bad or spec!r} not in {allowed}")
    return items


def routing(kind, T, E, K, seed=0, zipf_s=1.2):
    """(topk_ids int32 [T, K], topk_weights float32 [T, K]) with a controlled load.

    uniform: k distinct experts per token, uniformly at random; zipf: k distinct
    experts sampled without replacement with P(e) ~ 1/(e+1)^s (Gumbel top-k);
    all-to-one: every token to experts 0..k-1. Weights: random, summing to 1.
    """
    rng = np.random.default_rng(seed)
    if kind == "all-to-one":
        ids = np.tile(np.arange(K, dtype=np.int32), (T, 1))
    elif kind in ("uniform", "zipf"):
        logp = np.zeros(E) if kind == "uniform" else -zipf_s * np.log(np.arange(1, E + 1))
        g = logp + rng.gumbel(size=(T, E))
        ids = np.argsort(-g, axis=1, kind="stable")[:, :K].astype(np.int32)
    else:
        raise ValueError(f"routing kind {kind!r} not in {ROUTINGS}")
    w = rng.random((T, K)).astype(np.float32) + 0.1
    return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


def load_stats(ids, E):
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=E)
    return {"imbalance": float(counts.max() / counts.mean()), "max_load": int(counts.max()),
            "min_load": int(counts.min())}


def router_routing(x, router, K):
    aux = jax.jit(lambda x, r: mok_jax.route(x, r, top_k=K))(x, router)
    return np.asarray(aux.topk_ids), np.asarray(aux.topk_weights, np.float32)


def impl_available(impl, dtype, ep=1):
    """None if the implementation can run here, else why not."""
    backend = jax.default_backend()
    if impl.split("-")[0] == "cpu" and backend != "cpu":
        return "the cpu kernels need the CPU backend (run with JAX_PLATFORMS=cpu)"
    if impl in EP_IMPLS and len(jax.devices()) < ep:
        return f"--ep {ep} needs {ep} devices, {len(jax.devices())} visible"
    if impl.split("-")[0] == "cuda":
        if not _ffi.cuda_built():
            return f"CUDA backend unavailable: {_ffi.CUDA_UNAVAILABLE_REASON}"
        if backend not in ("gpu", "cuda") or not _ffi.cuda_device_supported():
            return "needs an sm_90 GPU"
        if dtype != jnp.bfloat16:
            return "bfloat16 only"
    if impl == "torch":
        if backend not in ("gpu", "cuda") or not torch_available():
            return "torch with CUDA (torch._grouped_mm) is not importable"
        if dtype != jnp.bfloat16:
            return "bfloat16 only"
    return None


def train_step(f, probe):
    """y and the gradients: a training step needs y (its loss), so y is an
    output and no path may drop its forward (a forward that keeps no
    residuals, such as dispatch="peer", would otherwise be dead code)."""
    def step(*a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(probe)
    return step


def jax_pass_fn(impl, pass_, data, probe, ep=1):
    """A zero-argument callable dispatching one pass (not blocking: median_ms
    blocks on its result)."""
    x, ids, w, wg, wu, wd = data
    call = experts_call(impl, ep)
    f = lambda x, w, wg, wu, wd: call(x, ids, w, wg, wu, wd)
    diff = (x, w, wg, wu, wd)
    if pass_ == "fwd":
        g = jax.jit(f)
        return lambda: g(*diff)
    if pass_ == "fwd+bwd":
        g = jax.jit(train_step(f, probe))
        return lambda: g(*diff)
    # bwd alone: the forward's residuals are computed once, outside the timing
    _, vjp = jax.jit(lambda *a: jax.vjp(f, *a))(*diff)
    g = jax.jit(lambda vjp, dy: vjp(dy))
    return lambda: g(vjp, probe)


def jax_memory(impl, data, probe, ep=1):
    """(residual bytes kept between forward and backward, peak bytes of a
    forward+backward step beyond its inputs) of mok_jax.experts."""
    x, ids, w, wg, wu, wd = data
    call = experts_call(impl, ep)
    f = lambda x, w, wg, wu, wd: call(x, ids, w, wg, wu, wd)
    diff = (x, w, wg, wu, wd)
    return jax_residual_bytes(f, diff), jax_step_peak_bytes(train_step(f, probe), diff)


def torch_memory(data, probe):
    """The same two figures for torch._grouped_mm + autograd."""
    import torch
    x, ids, w, wg, wu, wd = torch_problem(data)
    dy = torch.from_dlpack(probe)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    fwd = lambda: torch_moe_forward(leaves[0], ids, *leaves[1:])
    saved = torch_saved_bytes(fwd, leaves)
    peak = torch_step_peak_bytes(lambda: torch.autograd.grad(fwd(), leaves, dy))
    return saved, peak


def torch_pass_ms(pass_, data, probe, warmup, iters, pipeline=1):
    import torch
    x, ids, w, wg, wu, wd = torch_problem(data)
    dy = torch.from_dlpack(probe)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, wg, wu, wd)]
    fwd = lambda: torch_moe_forward(leaves[0], ids, *leaves[1:])
    if pass_ == "fwd":
        with torch.no_grad():
            return torch_timed(fwd, warmup, iters, pipeline)
    if pass_ == "fwd+bwd":
        return torch_timed(lambda: torch.autograd.grad(fwd(), leaves, dy), warmup, iters, pipeline)
    y = fwd()
    return torch_timed(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True),
                       warmup, iters, pipeline)


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Progress:
    """A plain-text progress bar, one line per finished step."""

    def __init__(self, total, stream=sys.stdout):
        self.total, self.done, self.t0, self.stream = total, 0, time.perf_counter(), stream

    def step(self, label):
        self.done += 1
        n = 24
        fill = int(n * self.done / max(self.total, 1))
        el = time.perf_counter() - self.t0
        print(f"[{'#' * fill}{'.' * (n - fill)}] {self.done}/{self.total} {el:6.1f}s  {label}",
              file=self.stream, flush=True)


def run(args):
    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    shapes = parse_shapes(args.shapes or ("cpu-s,cpu-m" if backend == "cpu" else "1,2,3,4"))
    passes = parse_list("passes", args.passes, PASSES)
    impls = parse_list("impls", args.impls or ("cpu,xla" if backend == "cpu" else "cuda,xla,torch"),
                       IMPLS)
    sweep = parse_list("sweep", args.sweep, ROUTINGS) if args.sweep else []
    sweep_shape = parse_shapes(args.sweep_shape)[0] if args.sweep_shape else shapes[0]
    skipped = {}
    runnable = []
    for impl in impls:
        why = impl_available(impl, dtype, args.ep)
        if why:
            skipped[impl] = why
            print(f"skipping impl={impl}: {why}", flush=True)
        else:
            runnable.append(impl)
    if "xla" in runnable:  # first, so the others' forward is checked against it
        runnable.remove("xla")
        runnable.insert(0, "xla")
    jobs = [(s, "router") for s in shapes] + [(sweep_shape, r) for r in sweep]
    total = len(jobs) * len(runnable) * len(passes)
    progress = Progress(total)
    dev = jax.devices()[0]
    n_dense = 8192 if backend != "cpu" else 1024
    dense = bench_dense_jax(1, max(3, args.iters // 2), n=n_dense, dtype=dtype, pipeline=args.pipeline)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "device": str(dev), "device_kind": dev.device_kind,
            "backend": backend, "dtype": dtype.name, "jax": jax.__version__,
            "mok_jax": mok_jax.__version__, "host": platform.node(),
            "cpu_count": os.cpu_count(), "dense_tflops": {"jax": dense}, "dense_n": n_dense,
            "flops": "useful FLOPs: fwd 6*T*k*H*F, bwd 2x (12*T*k*H*F), fwd+bwd 3x (18*T*k*H*F)",
            "iters": args.iters, "warmup": args.warmup, "pipeline": args.pipeline,
            "zipf_s": args.zipf_s, "ep": args.ep,
            "skipped_impls": skipped, "command": "python " + " ".join(sys.argv),
            "cuda_build_options": mok_jax.info.cuda_build_options()}
    if "torch" in runnable:
        import torch
        meta["torch"] = torch.__version__
        meta["dense_tflops"]["torch"] = torch_dense_tflops(1, max(3, args.iters // 2), pipeline=args.pipeline)
    print(f"device {dev.device_kind} ({backend}), dtype {dtype.name}, dense {n_dense}^3 matmul: "
          f"{dense:.3f} TFLOP/s", flush=True)

    rows = []
    for (name, T, H, F, E, K), kind in jobs:
        x, router, wg, wu, wd = weights(T, H, F, E, dtype, seed=args.seed)
        if kind == "router":
            ids, w = router_routing(x, router, K)
        else:
            ids, w = routing(kind, T, E, K, seed=args.seed, zipf_s=args.zipf_s)
        data = (x, jnp.asarray(ids), jnp.asarray(w), wg, wu, wd)
        probe = jax.random.normal(jax.random.key(args.seed + 7), (T, H), jnp.float32).astype(dtype)
        stats = load_stats(ids, E)
        y_ref = None
        for impl in runnable:
            for pass_ in passes:
                flops = useful_flops(T, H, F, K, pass_)
                row = {"shape": name, "T": T, "H": H, "F": F, "E": E, "k": K, "impl": impl,
                       "pass": pass_, "routing": kind, "useful_flops": flops, **stats}
                iters = args.xla_iters if impl == "xla" else args.iters
                try:
                    if impl == "torch":
                        ms = torch_pass_ms(pass_, data, probe, args.warmup, iters, args.pipeline)
                    else:
                        d, pr = place(impl, args.ep, data, probe)
                        fn = jax_pass_fn(impl, pass_, d, pr, args.ep)
                        ms = median_ms(fn, args.warmup, iters, args.pipeline)
                        row["peak_bytes"] = jax_peak_bytes()
                        if pass_ == "fwd" and kind == "router":
                            y = jax.jit(experts_call(impl, args.ep))(*d)
                            if impl == "xla":
                                y_ref = y
                            elif y_ref is not None:
                                row["rel_l2_vs_xla"] = rel_l2(y.astype(jnp.float32),
                                                              y_ref.astype(jnp.float32))
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                    if pass_ == "fwd+bwd" and kind == "router" and not args.no_memory:
                        saved, peak = (torch_memory(data, probe) if impl == "torch"
                                       else jax_memory(impl, *place(impl, args.ep, data, probe),
                                                       args.ep))
                        row.update(residual_bytes=saved, residual_bytes_per_row=saved / (T * K),
                                   step_peak_bytes=peak)
                except Exception as err:  # keep going: one failing peer must not lose the run
                    row.update(ms=None, tflops=None, error=f"{type(err).__name__}: {err}"[:300])
                rows.append(row)
                if args.partial:  # a run cut short still leaves its rows
                    with open(args.partial, "w") as f:
                        json.dump({"meta": meta, "rows": rows}, f, indent=1)
                tf = "-" if row["tflops"] is None else f"{row['tflops']:.3f} TF/s"
                ms_s = "-" if row["ms"] is None else f"{row['ms']:.2f} ms"
                progress.step(f"{name} {kind:10s} {impl:11s} {pass_:7s} {ms_s} {tf}"
                              + (f"  ERROR {row['error']}" if "error" in row else ""))
        del data, x, wg, wu, wd
    return {"meta": meta, "rows": rows}


def print_table(result, stream=sys.stdout):
    rows = result["rows"]
    print("\n| shape | routing | imbalance | impl | pass | ms | TFLOP/s | residual B/row "
          "| step peak GiB |", file=stream)
    print("|---|---|---|---|---|---|---|---|---|", file=stream)
    for r in rows:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        tf = "-" if r["tflops"] is None else f"{r['tflops']:.3f}"
        rb = f"{r['residual_bytes_per_row']:.0f}" if r.get("residual_bytes_per_row") else ""
        pk = f"{r['step_peak_bytes'] / 2**30:.2f}" if r.get("step_peak_bytes") else ""
        print(f"| {r['shape']} | {r['routing']} | {r['imbalance']:.2f} | {r['impl']} | "
              f"{r['pass']} | {ms} | {tf} | {rb} | {pk} |", file=stream)


OURS = ("cuda", "cpu", "auto")  # the implementation a RESULTS.md row reports, first found


def results_rows(result):
    """RESULTS.md lines for the main table (random-router routing): one per shape
    and pass, ours (the first of OURS that ran) beside torch and xla, the dense
    ceilings and the step peak (fwd+bwd rows with memory measured)."""
    meta = result["meta"]
    main = [r for r in result["rows"] if r["routing"] == "router"]
    by = {(r["shape"], r["impl"], r["pass"]): r for r in main}
    fmt = lambda v, p=1: "—" if v is None else f"{v:.{p}f}"
    dense = meta["dense_tflops"]
    lines = []
    for pass_ in PASSES:
        for shape in dict.fromkeys(r["shape"] for r in main):
            ours = next((by[(shape, i, pass_)] for i in OURS if (shape, i, pass_) in by), None)
            if ours is None:
                continue
            torch_r, xla_r = by.get((shape, "torch", pass_), {}), by.get((shape, "xla", pass_), {})
            peak = "—"
            if ours.get("step_peak_bytes"):
                tp = torch_r.get("step_peak_bytes")
                peak = f"{ours['step_peak_bytes'] / 2**30:.2f} / {fmt(tp and tp / 2**30, 2)} (step)"
            dims = f"({ours['T']},{ours['H']},{ours['F']},{ours['E']},{ours['k']})"
            lines.append(
                f"| {meta['date'][:10]} | {meta['commit']} | {meta['device_kind']} | {pass_} | "
                f"{shape} {dims} | {fmt(ours['ms'], 2)} | {fmt(ours['tflops'])} | "
                f"{fmt(torch_r.get('tflops'))} | {fmt(xla_r.get('tflops'))} | "
                f"{fmt(dense.get('jax'))} / {fmt(dense.get('torch'))} | {peak} | `{meta['command']}` |")
    return lines


def plot(result, out_dir, tag):
    """Writes <tag>_tflops.png and <tag>_imbalance.png; returns their paths
    ([] when matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots", flush=True)
        return []
    meta, rows = result["meta"], [r for r in result["rows"] if r["tflops"] is not None]
    label = f"{meta['device_kind']} ({meta['backend'].upper()}), {meta['dtype']}, {meta['date'][:10]}, {meta['commit']}"
    paths = []

    def panel(ax, sub, xkey, xlabels, title):
        impls = sorted({r["impl"] for r in sub}, key=IMPLS.index)
        width = 0.8 / max(len(impls), 1)
        for i, impl in enumerate(impls):
            vals = []
            for xl in xlabels:
                m = [r["tflops"] for r in sub if r["impl"] == impl and r[xkey] == xl]
                vals.append(m[0] if m else 0.0)
            ax.bar(np.arange(len(xlabels)) + (i - (len(impls) - 1) / 2) * width, vals, width,
                   label=impl)
        styles = {"jax": "--", "torch": ":"}
        for k, v in meta["dense_tflops"].items():
            ax.axhline(v, color="k", linestyle=styles.get(k, "-."), linewidth=1,
                       label=f"dense matmul ({k})")
        ax.set_xticks(np.arange(len(xlabels)))
        ax.set_xticklabels(xlabels, rotation=15, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("useful TFLOP/s")
        ax.legend(fontsize=7)

    main = [r for r in rows if r["routing"] == "router"]
    passes = [p for p in PASSES if any(r["pass"] == p for r in main)]
    if main and passes:
        shapes = list(dict.fromkeys(r["shape"] for r in main))
        fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 4), squeeze=False)
        for ax, p in zip(axes[0], passes):
            panel(ax, [r for r in main if r["pass"] == p], "shape", shapes, f"{p}")
        fig.suptitle(f"MoE TFLOP/s per shape: {label}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{tag}_tflops.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    sw = [r for r in rows if r["routing"] in ROUTINGS]
    passes = [p for p in PASSES if any(r["pass"] == p for r in sw)]
    if sw and passes:
        kinds = [k for k in ROUTINGS if any(r["routing"] == k for r in sw)]
        imb = {k: next(r["imbalance"] for r in sw if r["routing"] == k) for k in kinds}
        for r in sw:
            r["routing_label"] = f"{r['routing']}\n(max/mean {imb[r['routing']]:.1f})"
        xl = [f"{k}\n(max/mean {imb[k]:.1f})" for k in kinds]
        fig, axes = plt.subplots(1, len(passes), figsize=(5 * len(passes), 4), squeeze=False)
        for ax, p in zip(axes[0], passes):
            panel(ax, [r for r in sw if r["pass"] == p], "routing_label", xl, f"{p}")
        s = sw[0]
        fig.suptitle(f"Expert-load sweep, {s['shape']} (T={s['T']} H={s['H']} F={s['F']} "
                     f"E={s['E']} k={s['k']}): {label}", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{tag}_imbalance.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        for r in sw:
            r.pop("routing_label", None)
        paths.append(path)
    return paths


def main(argv=None):
    """Command line entry point; returns the result dict."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help="comma list: 1-4 (GPU shapes), cpu-s, cpu-m, or TxHxFxExK "
                        "(default: 1,2,3,4 on GPU, cpu-s,cpu-m on CPU)")
    p.add_argument("--impls", default=None, help=f"comma list of {IMPLS} "
                   "(default: cuda,xla,torch on GPU, cpu,xla on CPU)")
    p.add_argument("--passes", default="fwd,bwd,fwd+bwd", help="comma list of fwd,bwd,fwd+bwd")
    p.add_argument("--sweep", default="uniform,zipf,all-to-one",
                   help="expert-load sweep routings ('' for none)")
    p.add_argument("--sweep-shape", default=None, help="shape of the sweep (default: the first)")
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pipeline", type=int, default=1,
                   help="calls per timed sample, dispatched back to back and divided out "
                        "(1: per-call latency, each call blocked on; n > 1: the steady "
                        "state of a training loop); the same for torch")
    p.add_argument("--xla-iters", type=int, default=3, help="the pure-JAX reference is slow on GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ep", type=int, default=1,
                   help="devices of the expert-parallel implementations' mesh (*-peer, *-collective)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tag", default=None, help="file prefix (default: cpu or gpu)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--partial", default=None,
                   help="rewrite this JSON file after every row (for runs that may be cut short)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the residual-bytes / step-peak measurement of fwd+bwd rows")
    p.add_argument("--record", nargs="?", const=os.path.join(HERE, "RESULTS.md"), default=None,
                   metavar="PATH", help="append the main table's rows to PATH "
                   "(default: benchmarks/RESULTS.md)")
    args = p.parse_args(argv)
    if args.pipeline < 1 or args.iters < 1:
        p.error("--pipeline and --iters must be at least 1")
    tag = args.tag or ("cpu" if jax.default_backend() == "cpu" else "gpu")
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{tag}_latest.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print_table(result)
    print(f"\nwrote {path}")
    if args.record:
        with open(args.record, "a") as f:
            f.write("\n".join(results_rows(result)) + "\n")
        print(f"appended to {args.record}")
    if not args.no_plots:
        for pth in plot(result, args.out, tag):
            print(f"wrote {pth}")
    return result


if __name__ == "__main__":
    main()
