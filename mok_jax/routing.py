"""`route`: steps 1-2 of the layer (router logits, scores, top-k selection,
combine weights) and the auxiliary values. Always pure JAX in float32; its
backward is JAX's autodiff."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _validate as V


class MoEAux(NamedTuple):
    """Auxiliary outputs of `route` / `moe_layer` (all jittable arrays).

    tokens_per_expert: ``[E]`` int32, routed (token, k) pairs per expert.
    load_balancing_loss: Switch/GShard ``E * sum_e f_e * P_e`` (f: fraction of
      pairs routed to e, P: mean normalised router score of e), float32 scalar.
    router_z_loss: ``mean(logsumexp(logits)**2)``, float32 scalar.
    topk_ids: ``[..., K]`` int32 chosen experts.
    topk_weights: ``[..., K]`` float32 combine weights.
    """
    tokens_per_expert: jax.Array
    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    topk_ids: jax.Array
    topk_weights: jax.Array


def route(x, router_kernel, *, top_k, score_func="softmax", normalize_topk=True,
          router_bias=None, routed_scaling_factor=1.0, token_mask=None):
    """Router logits -> scores -> top-k selection and weights, plus aux values.

    Args:
      x: ``[..., H]`` tokens.
      router_kernel: ``[H, E]``; logits are computed in float32.
      top_k: experts per token, in ``[1, E]``.
      score_func: "softmax" or "sigmoid".
      normalize_topk: renormalise the chosen weights to sum to 1.
      router_bias: optional ``[E]`` added to the scores for *selection only*
        (DeepSeek-V3 aux-loss-free balancing); the weights stay unbiased.
      routed_scaling_factor: multiplies the final weights.
      token_mask: optional bool ``[...]``; False tokens count in no aux value
        (their ids/weights are still returned, and `experts` skips them).

    Returns:
      MoEAux with ``topk_ids`` and ``topk_weights`` of shape ``[..., top_k]``.
    """
    x = jnp.asarray(x)
    router_kernel = jnp.asarray(router_kernel)
    V.check_float("x", x)
    V.check_rank("router_kernel", router_kernel, 2, "[H, E]")
    H = x.shape[-1]
    if router_kernel.shape[0] != H:
        raise ValueError(f"router_kernel has shape {tuple(router_kernel.shape)}; axis 0 must be "
                         f"H={H} (x's last axis), layout [H, E]")
    E = router_kernel.shape[1]
    V.check_top_k(top_k, E)
    V.check_choice("score_func", score_func, V.SCORE_FUNCS)
    if router_bias is not None:
        router_bias = jnp.asarray(router_bias)
        V.check_shape("router_bias", router_bias, (E,), "[E]")
    token_mask = V.check_token_mask(token_mask, x)

    with jax.named_scope("mok_route"):
        return _route(x, router_kernel, top_k, score_func, normalize_topk, router_bias,
                      routed_scaling_factor, token_mask)


def _route(x, router_kernel, top_k, score_func, normalize_topk, router_bias,
           routed_scaling_factor, token_mask):
    H = x.shape[-1]
    E = router_kernel.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, H).astype(jnp.float32)
    logits = jnp.dot(x2, router_kernel.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    if score_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    select = scores if router_bias is None else scores + router_bias.astype(jnp.float32)
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(select), top_k)  # ties: lower id first
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * jnp.float32(routed_scaling_factor)

    mask = jnp.ones(x2.shape[0], bool) if token_mask is None else token_mask.reshape(-1)
    live = mask.astype(jnp.float32)
    n_live = jnp.maximum(jnp.sum(live), 1.0)
    one_hot = jax.nn.one_hot(ids, E, dtype=jnp.float32) * live[:, None, None]
    counts = jnp.sum(one_hot, axis=(0, 1))
    f = counts / (n_live * top_k)
    probs = scores if score_func == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    p = jnp.sum(probs * live[:, None], axis=0) / n_live
    lb_loss = E * jnp.sum(jax.lax.stop_gradient(f) * p)
    z_loss = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * live) / n_live
    return MoEAux(
        tokens_per_expert=counts.astype(jnp.int32),
        load_balancing_loss=lb_loss,
        router_z_loss=z_loss,
        topk_ids=ids.astype(jnp.int32).reshape(*lead, top_k),
        topk_weights=weights.reshape(*lead, top_k),
    )
