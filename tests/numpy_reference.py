"""An independent float64 NumPy reference of the layer and of its gradients
(hand-derived, per (token, k) pair: no shared code with the kernels or JAX)."""

import numpy as np


def silu(v):
    return v / (1.0 + np.exp(-v))


def dsilu(v):
    s = 1.0 / (1.0 + np.exp(-v))
    return s * (1.0 + v * (1.0 - s))


def route(x, router, top_k, score_func="softmax", normalize=True, bias=None, scale=1.0,
          mask=None):
    x = np.asarray(x, np.float64).reshape(-1, router.shape[0])
    logits = x @ np.asarray(router, np.float64)
    if score_func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    sel = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(scores, ids, -1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    w = w * scale
    T, E = scores.shape
    live = np.ones(T, bool) if mask is None else np.asarray(mask).reshape(-1)
    n = max(live.sum(), 1)
    counts = np.zeros(E)
    for t in np.nonzero(live)[0]:
        for e in ids[t]:
            counts[e] += 1
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdims=True)
    lb = E * np.sum(counts / (n * top_k) * probs[live].sum(0) / n)
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
    z = np.sum(lse[live] ** 2) / n
    return ids, w, counts.astype(np.int64), lb, z


def _f64(*arrays):
    return [None if a is None else np.asarray(a, np.float64) for a in arrays]


def experts(x, ids, w, wg, wu, wd, shared=None, mask=None):
    x, w, wg, wu, wd = _f64(x, w, wg, wu, wd)
    T, K = ids.shape
    live = np.ones(T, bool) if mask is None else np.asarray(mask)
    y = np.zeros_like(x)
    for t in np.nonzero(live)[0]:
        for k in range(K):
            e = ids[t, k]
            y[t] += w[t, k] * (silu(x[t] @ wg[e]) * (x[t] @ wu[e])) @ wd[e]
        if shared is not None:
            sg, su, sd = _f64(*shared)
            y[t] += (silu(x[t] @ sg) * (x[t] @ su)) @ sd
    return y


def _ffn_grads(xt, dyt, scale, g_w, u_w, d_w, grads, gi):
    """Adds one SwiGLU FFN row's gradients; returns (dx row, <dy, out>/scale)."""
    g, u = xt @ g_w, xt @ u_w
    act = silu(g) * u
    gd = d_w @ dyt                      # d act / scale
    dot = gd @ act                      # <dy, act @ d_w>
    da = scale * gd
    dg, du = da * u * dsilu(g), da * silu(g)
    grads[gi[0]] += np.outer(xt, dg)
    grads[gi[1]] += np.outer(xt, du)
    grads[gi[2]] += np.outer(act, scale * dyt)
    return g_w @ dg + u_w @ du, dot


def experts_grads(x, ids, w, wg, wu, wd, dy, shared=None, mask=None):
    """(dx, dw, dwg, dwu, dwd, (dsg, dsu, dsd) or None) of sum(y * dy)."""
    x, w, wg, wu, wd, dy = _f64(x, w, wg, wu, wd, dy)
    T, K = ids.shape
    live = np.ones(T, bool) if mask is None else np.asarray(mask)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    sh = None if shared is None else _f64(*shared)
    dsh = None if sh is None else [np.zeros_like(a) for a in sh]
    for t in np.nonzero(live)[0]:
        for k in range(K):
            e = ids[t, k]
            views = [dwg[e], dwu[e], dwd[e]]
            dxt, dot = _ffn_grads(x[t], dy[t], w[t, k], wg[e], wu[e], wd[e], views, (0, 1, 2))
            dx[t] += dxt
            dw[t, k] = dot
        if sh is not None:
            dxt, _ = _ffn_grads(x[t], dy[t], 1.0, *sh, dsh, (0, 1, 2))
            dx[t] += dxt
    return dx, dw, dwg, dwu, dwd, dsh
