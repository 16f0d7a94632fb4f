"""`moe_layer`: route, then experts, in one call."""

from __future__ import annotations

from .experts import experts
from .routing import route


def moe_layer(x, router_kernel, w_gate, w_up, w_down, *, top_k, score_func="softmax",
              normalize_topk=True, router_bias=None, routed_scaling_factor=1.0,
              shared_experts=None, token_mask=None, implementation="auto"):
    """A dropless mixture-of-experts SwiGLU layer.

    ``y = sum_k w_k * down_e(silu(x @ gate_e) * (x @ up_e)) + shared(x)`` over the
    top_k experts of each token, computed without dropping any token.

    Args:
      x: ``[..., H]`` float32 or bfloat16 tokens (leading axes are flattened).
      router_kernel: ``[H, E]`` router weights (the router runs in float32).
      w_gate, w_up: ``[E, H, F]``; w_down: ``[E, F, H]``, in x's dtype.
      top_k: experts per token, in ``[1, E]``.
      score_func: "softmax" or "sigmoid".
      normalize_topk: renormalise the chosen scores to sum to 1 (default True).
      router_bias: optional ``[E]`` selection-only bias (aux-loss-free balancing).
      routed_scaling_factor: scales the combine weights.
      shared_experts: None, ``(ws_gate[H, Fs], ws_up[H, Fs], ws_down[Fs, H])`` or a
        list of them; applied to every (unmasked) token.
      token_mask: optional bool ``[...]``: False marks padding tokens; they are not
        dispatched, their output is exactly zero and they count in no aux value.
      implementation: "xla" (pure JAX reference), "cpu" (the C++ FFI kernels),
        "cuda" (the Hopper megakernel, bfloat16), or "auto" (the FFI kernel of
        the default backend where one applies, else "xla").

    Returns:
      ``(y, aux)``: y in x's shape and dtype; aux a `MoEAux`.
    """
    aux = route(x, router_kernel, top_k=top_k, score_func=score_func,
                normalize_topk=normalize_topk, router_bias=router_bias,
                routed_scaling_factor=routed_scaling_factor, token_mask=token_mask)
    y = experts(x, aux.topk_ids, aux.topk_weights, w_gate, w_up, w_down,
                shared_experts=shared_experts, token_mask=token_mask,
                implementation=implementation)
    return y, aux
