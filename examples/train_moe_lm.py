"""Train a small decoder-only MoE language model with mok_jax, Flax NNX and optax.

Every feed-forward block is a `mok_jax.nnx.MoE` (top-k routed SwiGLU experts,
load-balancing and z-loss, optional aux-loss-free router bias). The model is
byte-level (vocabulary 256) and trains on text that ships with CPython itself:
the Python documentation topics in ``pydoc_data.topics`` (~0.5 MB of English,
the text behind ``help("assert")`` and friends), so nothing is downloaded.

    python examples/train_moe_lm.py                        # tiny CPU config, ~2 min
    python examples/train_moe_lm.py --config gpu           # larger, bf16, on a GPU
    python examples/train_moe_lm.py --ckpt-dir /tmp/moe_lm --steps 400   # checkpoints
    python examples/train_moe_lm.py --ckpt-dir /tmp/moe_lm --steps 800 --resume

Logs every ``--log-every`` steps: a progress bar, train loss, validation loss
(every ``--eval-every``), aux loss, tokens/s and each layer's expert load
(tokens per expert as a fraction, and max/mean imbalance). Orbax checkpoints
(model, optimiser state and step) go to ``--ckpt-dir``; ``--resume`` continues
from the latest one with the same data order. ``--moe-share`` also measures
the MoE layers' share of the step time. Needs flax, optax and (for
checkpoints) orbax-checkpoint: ``pip install 'mok_jax[examples]'``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mok_jax.nnx as mnnx

CONFIGS = {
    # ~0.2M parameters: the loss falls from ln(256)=5.5 to ~2.5 in a few hundred CPU steps.
    "tiny": dict(d_model=64, layers=2, heads=4, experts=4, top_k=2, ffn=128, seq=64, batch=16,
                 steps=300, lr=3e-3, dtype="float32"),
    # A GPU-sized model (bf16, so implementation="auto" picks the CUDA kernels on Hopper).
    "gpu": dict(d_model=1024, layers=8, heads=16, experts=32, top_k=4, ffn=768, seq=1024,
                batch=32, steps=2000, lr=6e-4, dtype="bfloat16"),
}


# ----------------------------------------------------------------------------- data
def load_corpus():
    """The Python documentation topics shipped with CPython, as bytes."""
    try:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))
    except ImportError:  # a stripped Python: fall back to the Zen and the stdlib sources
        import this  # noqa: F401  (prints the Zen once)
        import codecs
        text = codecs.decode(this.s, "rot13") + "\n" + inspect.getsource(inspect)
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def batch_at(data, step, batch, seq, seed):
    """The batch of a given step: deterministic in (seed, step), so a resumed
    run sees the same data order. Returns (inputs, targets) int32 [batch, seq]."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    chunk = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------- model
_List = getattr(nnx, "List", list)  # flax >= 0.12 wants nnx.List for lists of modules


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, d, heads, dtype, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        B, T, D = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
        return self.out(y.reshape(B, T, D))


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + MoE(norm(x))."""

    def __init__(self, cfg, rngs):
        d, dt = cfg["d_model"], jnp.dtype(cfg["dtype"])
        self.norm1 = nnx.RMSNorm(d, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.attn = Attention(d, cfg["heads"], dt, rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.moe = mnnx.MoE(d, cfg["ffn"], cfg["experts"], cfg["top_k"],
                            param_dtype=dt, aux_loss_coeff=cfg["aux_loss_coeff"],
                            z_loss_coeff=cfg["z_loss_coeff"], router_bias=cfg["router_bias"],
                            router_bias_update_rate=cfg["router_bias_rate"],
                            implementation=cfg["implementation"], rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoELM(nnx.Module):
    """Byte-level decoder-only transformer whose FFNs are `mok_jax.nnx.MoE`."""

    def __init__(self, cfg, rngs):
        d, dt = cfg["d_model"], jnp.dtype(cfg["dtype"])
        self.embed = nnx.Embed(256, d, dtype=dt, param_dtype=jnp.float32, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg["seq"], d)) * 0.02)
        self.blocks = _List([Block(cfg, rngs) for _ in range(cfg["layers"])])
        self.norm = nnx.RMSNorm(d, dtype=dt, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + mnnx._get(self.pos)[: tokens.shape[1]].astype(self.embed.dtype)
        for blk in self.blocks:
            x = blk(x)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)  # tied output head


def _optimizer(model, tx):
    try:
        return nnx.Optimizer(model, tx, wrt=nnx.Param)
    except TypeError:  # flax < 0.11
        return nnx.Optimizer(model, tx)


def _opt_update(opt, model, grads):
    try:
        opt.update(model, grads)
    except TypeError:  # flax < 0.11
        opt.update(grads)


def loss_terms(model, inputs, targets):
    logits = model(inputs)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return ce, mnnx.aux_loss(model)


@nnx.jit
def train_step(model, opt, inputs, targets):
    def loss_fn(model):
        ce, aux = loss_terms(model, inputs, targets)
        return ce + aux, (ce, aux)
    (_, (ce, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    _opt_update(opt, model, grads)
    return ce, aux


@nnx.jit
def eval_step(model, inputs, targets):
    return loss_terms(model, inputs, targets)[0]


@nnx.jit
def update_biases(model):
    mnnx.update_router_biases(model)


# ----------------------------------------------------------------------------- helpers
def _bar(done, total, width=20):
    fill = int(width * done / max(total, 1))
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


def format_load(loads):
    """Per layer: token fractions per expert and max/mean imbalance."""
    parts = []
    for i, c in enumerate(loads):
        c = np.asarray(c, np.float64)
        frac = c / max(c.sum(), 1)
        parts.append(f"L{i} [{' '.join(f'{f:.2f}' for f in frac)}] x{c.max() / max(c.mean(), 1e-9):.2f}")
    return "; ".join(parts)


def measure_moe_share(model, cfg, step_ms, iters=5):
    """Times forward+backward of every MoE layer alone on random activations of
    the step's size and returns its share of one training step."""
    B, S, d = cfg["batch"], cfg["seq"], cfg["d_model"]
    x = jax.random.normal(jax.random.key(0), (B, S, d), jnp.float32).astype(cfg["dtype"])

    @nnx.jit
    def moe_only(model, x):
        def f(model):
            return sum(jnp.sum(blk.moe(x).astype(jnp.float32)) for blk in model.blocks)
        return nnx.grad(f)(model)

    jax.block_until_ready(moe_only(model, x))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(moe_only(model, x))
    moe_ms = 1e3 * (time.perf_counter() - t0) / iters
    return moe_ms, moe_ms / step_ms


def _checkpoint_manager(path):
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise SystemExit("--ckpt-dir needs orbax-checkpoint (pip install orbax-checkpoint)")
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    return ocp, ocp.CheckpointManager(os.path.abspath(path), options=opts)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", choices=sorted(CONFIGS), default=None,
                   help="tiny on CPU, gpu elsewhere (default: by backend)")
    for k in ("d_model", "layers", "heads", "experts", "top_k", "ffn", "seq", "batch", "steps"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--z-loss-coeff", type=float, default=1e-3)
    p.add_argument("--router-bias", action="store_true",
                   help="aux-loss-free balancing: a router bias updated after every step")
    p.add_argument("--router-bias-rate", type=float, default=1e-3)
    p.add_argument("--implementation", default="auto")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop (and checkpoint) at this step, as if interrupted; --resume continues")
    p.add_argument("--moe-share", action="store_true",
                   help="measure the MoE layers' share of a step (always on with --config gpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the run summary here")
    return p.parse_args(argv)


def main(argv=None, out=sys.stdout):
    """Trains; returns a summary dict (losses per step, start step, tokens/s, ...)."""
    args = parse_args(argv)
    name = args.config or ("tiny" if jax.default_backend() == "cpu" else "gpu")
    cfg = dict(CONFIGS[name])
    for k in ("d_model", "layers", "heads", "experts", "top_k", "ffn", "seq", "batch", "steps",
              "lr", "dtype"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    cfg.update(aux_loss_coeff=args.aux_loss_coeff, z_loss_coeff=args.z_loss_coeff,
               router_bias=args.router_bias, router_bias_rate=args.router_bias_rate,
               implementation=args.implementation)
    log = lambda *a: print(*a, file=out, flush=True)

    data = load_corpus()
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    model = MoELM(cfg, nnx.Rngs(args.seed))
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], min(100, cfg["steps"] // 10 + 1),
                                               max(cfg["steps"], 2), cfg["lr"] * 0.1)
    opt = _optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                        optax.adamw(sched, weight_decay=0.01)))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    log(f"config {name}: {json.dumps({k: v for k, v in cfg.items()})}")
    log(f"{n_params / 1e6:.2f}M parameters; corpus {len(data) / 1e3:.0f} kB "
        f"(pydoc_data.topics); device {jax.devices()[0].device_kind}")

    start = 0
    mngr = None
    if args.ckpt_dir:
        ocp, mngr = _checkpoint_manager(args.ckpt_dir)
        if args.resume and mngr.latest_step() is not None:
            state = nnx.state((model, opt))
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
            nnx.update((model, opt), restored)
            start = int(mngr.latest_step())
            log(f"resumed from {args.ckpt_dir} at step {start}")
        elif args.resume:
            log(f"no checkpoint in {args.ckpt_dir}: starting from scratch")

    tokens_per_step = cfg["batch"] * cfg["seq"]
    losses, vals, window, step_ms, tps = {}, {}, [], None, None
    t_window, n_timed = time.perf_counter(), 0  # throughput excludes the compiling first step
    end = cfg["steps"] if args.stop_at is None else min(args.stop_at, cfg["steps"])
    for step in range(start, end):
        x, y = batch_at(train, step, cfg["batch"], cfg["seq"], args.seed)
        ce, aux = train_step(model, opt, jnp.asarray(x), jnp.asarray(y))
        if cfg["router_bias"]:
            update_biases(model)
        ce = float(ce)
        if not math.isfinite(ce):
            raise SystemExit(f"loss is {ce} at step {step}")
        losses[step] = ce
        window.append(ce)
        done = step + 1
        if step == start:
            t_window, n_timed = time.perf_counter(), 0
        else:
            n_timed += 1
        if done % args.eval_every == 0 or done == cfg["steps"]:
            vx, vy = batch_at(val, 10**6 + step, cfg["batch"], cfg["seq"], args.seed)
            vals[done] = float(eval_step(model, jnp.asarray(vx), jnp.asarray(vy)))
        if done % args.log_every == 0 or done == end:
            el = time.perf_counter() - t_window
            if n_timed:
                tps = n_timed * tokens_per_step / el
                step_ms = 1e3 * el / n_timed
            v = f" val {vals[done]:.3f}" if done in vals else ""
            log(f"{_bar(done, cfg['steps'])} loss {np.mean(window):.3f}{v} aux {float(aux):.4f} "
                f"{tps or 0:,.0f} tok/s | load {format_load(mnnx.expert_load(model))}")
            window, t_window, n_timed = [], time.perf_counter(), 0
        if mngr is not None and (done % args.ckpt_every == 0 or done == end):
            mngr.save(done, args=ocp.args.StandardSave(nnx.state((model, opt))))
    if mngr is not None:
        mngr.wait_until_finished()
        log(f"checkpoint: {args.ckpt_dir} step {mngr.latest_step()}")
    summary = {"config": name, "cfg": cfg, "start_step": start, "steps": cfg["steps"],
               "losses": losses, "val_losses": vals, "tokens_per_s": tps,
               "final_load": [np.asarray(c).tolist() for c in mnnx.expert_load(model)]}
    if (args.moe_share or name == "gpu") and step_ms:
        moe_ms, share = measure_moe_share(model, cfg, step_ms)
        log(f"MoE layers fwd+bwd: {moe_ms:.2f} ms of a {step_ms:.2f} ms step ({100 * share:.0f}%)")
        summary.update(moe_ms=moe_ms, step_ms=step_ms, moe_share=share)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=float)
    return summary


if __name__ == "__main__":
    main()
