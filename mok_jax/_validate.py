"""Trace-time argument checks: every error names the argument and what was expected."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

SCORE_FUNCS = ("softmax", "sigmoid")
IMPLEMENTATIONS = ("auto", "xla", "cpu", "cuda")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {choices}")


def check_bool(name, value):
    """value itself when it is a bool (not merely truthy), else a TypeError naming it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_rank(name, arr, rank, layout):
    if arr.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(arr.shape)}")


def check_shape(name, arr, shape, layout):
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(arr.shape)}, expected {tuple(shape)} ({layout})")


def check_float(name, arr):
    if arr.dtype not in [np.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} has dtype {arr.dtype}; expected float32 or bfloat16")


def check_same_dtype(name, arr, x):
    if arr.dtype != x.dtype:
        raise TypeError(
            f"{name} has dtype {arr.dtype} but x has dtype {x.dtype}; expert weights must "
            "match x's dtype (cast them, e.g. w.astype(x.dtype))")


def check_top_k(top_k, num_experts):
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be a Python int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}] (the number of experts)")


def check_expert_weights(x, w_gate, w_up, w_down):
    """Returns (E, H, F) after checking the routed experts' shapes against x."""
    H = x.shape[-1]
    check_rank("w_gate", w_gate, 3, "[E, H, F]")
    E, Hg, F = w_gate.shape
    if Hg != H:
        raise ValueError(f"w_gate has shape {tuple(w_gate.shape)}; its axis 1 must be H={H} "
                         "(x's last axis), layout [E, H, F]")
    check_shape("w_up", w_up, (E, H, F), "[E, H, F], same as w_gate")
    check_shape("w_down", w_down, (E, F, H), "[E, F, H]")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_same_dtype(name, w, x)
    return E, H, F


def normalize_shared(shared_experts, x):
    """Accepts None, one (ws_gate[H,Fs], ws_up[H,Fs], ws_down[Fs,H]) tuple or a
    list of them; several shared experts are one expert with their F axes
    concatenated (their outputs add). Returns a tuple of 3 arrays or None."""
    if shared_experts is None:
        return None
    if len(shared_experts) == 3 and all(hasattr(a, "shape") for a in shared_experts):
        shared_experts = [shared_experts]
    H = x.shape[-1]
    gates, ups, downs = [], [], []
    for i, se in enumerate(shared_experts):
        if len(se) != 3:
            raise ValueError(f"shared_experts[{i}] must be (ws_gate, ws_up, ws_down)")
        g, u, d = (jnp.asarray(a) for a in se)
        check_rank(f"shared_experts[{i}][0] (ws_gate)", g, 2, "[H, Fs]")
        Fs = g.shape[1]
        check_shape(f"shared_experts[{i}][0] (ws_gate)", g, (H, Fs), "[H, Fs]")
        check_shape(f"shared_experts[{i}][1] (ws_up)", u, (H, Fs), "[H, Fs]")
        check_shape(f"shared_experts[{i}][2] (ws_down)", d, (Fs, H), "[Fs, H]")
        for j, a in enumerate((g, u, d)):
            check_same_dtype(f"shared_experts[{i}][{j}]", a, x)
        gates.append(g), ups.append(u), downs.append(d)
    if not gates:
        return None
    if len(gates) == 1:
        return gates[0], ups[0], downs[0]
    return (jnp.concatenate(gates, 1), jnp.concatenate(ups, 1), jnp.concatenate(downs, 0))


def check_token_mask(token_mask, x):
    if token_mask is None:
        return None
    token_mask = jnp.asarray(token_mask)
    check_shape("token_mask", token_mask, x.shape[:-1], "x's shape without the last axis H")
    if token_mask.dtype != jnp.bool_:
        raise TypeError(f"token_mask has dtype {token_mask.dtype}; expected bool "
                        "(True = real token, False = padding)")
    return token_mask


class FlatExperts(NamedTuple):
    """`experts` arguments checked and flattened to T = prod(x.shape[:-1]) rows."""
    x: object         # the original x (its shape is the output's)
    x2: object        # [T, H]
    ids2: object      # [T, K] int32
    w2: object        # [T, K] float32
    mask2: object     # [T] bool
    shared: object    # None or (ws_gate, ws_up, ws_down)
    dims: tuple       # (E, H, F, K, T)


def flatten_experts_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_experts,
                         token_mask):
    """The checks of `experts` (shared by the expert-parallel entry points)."""
    x = jnp.asarray(x)
    topk_ids = jnp.asarray(topk_ids)
    topk_weights = jnp.asarray(topk_weights)
    check_float("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., H], got shape {tuple(x.shape)}")
    E, H, F = check_expert_weights(x, w_gate, w_up, w_down)
    lead = x.shape[:-1]
    if topk_ids.ndim != x.ndim or topk_ids.shape[:-1] != lead:
        raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected "
                         f"{tuple(lead)} + (K,) (x's leading axes, then top_k)")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; expected an integer dtype")
    check_shape("topk_weights", topk_weights, topk_ids.shape, "same as topk_ids")
    K = topk_ids.shape[-1]
    if K < 1:
        raise ValueError("topk_ids must have at least one expert per token (K >= 1)")
    token_mask = check_token_mask(token_mask, x)
    shared = normalize_shared(shared_experts, x)
    T = math.prod(lead)
    mask2 = jnp.ones((T,), bool) if token_mask is None else token_mask.reshape(T)
    return FlatExperts(x, x.reshape(T, H), topk_ids.reshape(T, K).astype(jnp.int32),
                       topk_weights.reshape(T, K).astype(jnp.float32), mask2, shared,
                       (E, H, F, K, T))
