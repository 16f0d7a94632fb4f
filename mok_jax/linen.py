"""Flax Linen module for the mok_jax MoE layer: ``mok_jax.linen.MoE``.

A thin wrapper over `mok_jax.moe_layer`. Parameters carry logical axis names
(`flax.linen.with_logical_partitioning`), the aux-loss-free router bias lives
in its own variable collection ``"moe_bias"`` (not ``"params"``: optimisers
never see it), and the losses and loads are sown into ``"intermediates"``::

    import jax, jax.numpy as jnp
    import mok_jax.linen

    layer = mok_jax.linen.MoE(num_experts=8, top_k=2, ffn_size=128,
                              aux_loss_coeff=1e-2, router_bias=True)
    x = jnp.ones((4, 16, 64), jnp.bfloat16)
    variables = layer.init(jax.random.key(0), x)
    y, state = layer.apply(variables, x, mutable=["intermediates"])
    extra_loss = mok_jax.linen.aux_loss(state["intermediates"])
    # after the optimiser step, outside the gradient:
    new_bias = mok_jax.linen.apply_router_bias_updates(variables["moe_bias"],
                                                       state["intermediates"])

Requires flax (``pip install 'mok_jax[flax]'``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import flax.linen as nn

from . import _validate as V
from .config import MegakernelConfig, check_megakernel
from .layer import moe_layer
from .nnx import (EXPERT_DOWN_AXES, EXPERT_KERNEL_AXES, ROUTER_AXES, check_config,
                  compute_dtype, default_kernel_init, router_bias_update)

__all__ = ["MoE", "aux_loss", "apply_router_bias_updates", "router_bias_update",
           "BIAS_COLLECTION", "EXPERT_KERNEL_AXES", "EXPERT_DOWN_AXES", "ROUTER_AXES"]

#: The variable collection holding the (non-trainable) router biases.
BIAS_COLLECTION = "moe_bias"


class MoE(nn.Module):
    """A dropless mixture-of-experts SwiGLU layer (Flax Linen) over `mok_jax.moe_layer`.

    The hidden size is x's last axis (``hidden_size``, if given, is checked
    against it).

    Attributes:
      num_experts: E.
      top_k: experts per token, in ``[1, E]``.
      ffn_size: F, each routed expert's intermediate size.
      hidden_size: optional H to check x against.
      shared_ffn_size: Fs of an always-on shared expert (0: none).
      score_func: "softmax" or "sigmoid".
      normalize_topk: renormalise the chosen scores to sum to 1.
      routed_scaling_factor: multiplies the combine weights.
      dtype: compute dtype of the experts (None: promote x's and param_dtype).
      param_dtype: dtype of the expert kernels, default bfloat16.
      router_dtype: dtype of the router kernel, default float32.
      kernel_init / router_init: initialisers (``[E, H, F]``-shaped calls for
        the experts, ``[H, E]`` for the router).
      router_bias: keep a ``moe_bias/router_bias`` ``[E]`` variable added to the
        scores for selection only; the module sows its update
        ``rate * sign(mean_load - load)`` as ``intermediates/router_bias_update``
        and `apply_router_bias_updates` applies it outside the gradient.
      router_bias_update_rate: that rate.
      aux_loss_coeff / z_loss_coeff: weights of the load-balancing loss and the
        router z-loss in the sown ``aux_loss``.
      implementation: "auto", "xla", "cpu" or "cuda" (see `mok_jax.moe_layer`).
      megakernel: None or a `mok_jax.MegakernelConfig` for the CUDA forward
        (see `mok_jax.moe_layer`); never changes the result.
      recompute: re-run the expert forward in the backward instead of keeping
        its residuals (see `mok_jax.moe_layer`).
      mesh / expert_axis / token_axes / dispatch: expert parallelism, as in
        `mok_jax.moe_layer`: with a `jax.sharding.Mesh`, the expert weights
        are split along E over ``expert_axis`` and the tokens over
        ``token_axes``; ``dispatch`` "collective", "peer" or "auto". None:
        one device's layer (XLA gathers sharded weights as needed).

    Sown into ``"intermediates"`` on every call (collect with
    ``mutable=["intermediates"]``): ``aux_loss`` (coefficient-weighted,
    differentiable), ``load_balancing_loss``, ``router_z_loss``,
    ``tokens_per_expert`` and, with a router bias, ``router_bias_update``.
    """

    num_experts: int
    top_k: int
    ffn_size: int
    hidden_size: Optional[int] = None
    shared_ffn_size: int = 0
    score_func: str = "softmax"
    normalize_topk: bool = True
    routed_scaling_factor: float = 1.0
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.bfloat16
    router_dtype: Any = jnp.float32
    kernel_init: Optional[Callable] = None
    router_init: Optional[Callable] = None
    router_bias: bool = False
    router_bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    implementation: str = "auto"
    megakernel: Optional[MegakernelConfig] = None
    recompute: bool = False
    mesh: Optional[Any] = None
    expert_axis: Optional[str] = None
    token_axes: Optional[Any] = None
    dispatch: str = "auto"

    @nn.compact
    def __call__(self, x, token_mask=None):
        """Applies the layer.

        Args:
          x: ``[..., H]`` tokens (float32 or bfloat16).
          token_mask: optional bool ``[...]``; False marks padding tokens (not
            dispatched, output zero, counted in no loss nor load).

        Returns:
          ``y`` ``[..., H]`` in the compute dtype.
        """
        check_config(hidden_size=self.hidden_size, ffn_size=self.ffn_size,
                     num_experts=self.num_experts, top_k=self.top_k,
                     shared_ffn_size=self.shared_ffn_size, score_func=self.score_func,
                     implementation=self.implementation, aux_loss_coeff=self.aux_loss_coeff,
                     z_loss_coeff=self.z_loss_coeff,
                     router_bias_update_rate=self.router_bias_update_rate,
                     dtype=self.dtype, param_dtype=self.param_dtype)
        megakernel = check_megakernel(self.megakernel)
        x = jnp.asarray(x)
        V.check_float("x", x)
        if x.ndim < 1:
            raise ValueError(f"x must be [..., H], got shape {tuple(x.shape)}")
        H, F, E = x.shape[-1], self.ffn_size, self.num_experts
        if self.hidden_size is not None and H != self.hidden_size:
            raise ValueError(f"x has shape {tuple(x.shape)}; its last axis must be "
                             f"hidden_size={self.hidden_size}")
        kinit = self.kernel_init or default_kernel_init()
        rinit = self.router_init or nn.initializers.lecun_normal()
        part = nn.with_logical_partitioning
        router = self.param("router_kernel", part(rinit, ROUTER_AXES), (H, E), self.router_dtype)
        wg = self.param("w_gate", part(kinit, EXPERT_KERNEL_AXES), (E, H, F), self.param_dtype)
        wu = self.param("w_up", part(kinit, EXPERT_KERNEL_AXES), (E, H, F), self.param_dtype)
        wd = self.param("w_down", part(kinit, EXPERT_DOWN_AXES), (E, F, H), self.param_dtype)
        cdt = compute_dtype(self.dtype, x.dtype, self.param_dtype)
        shared = None
        if self.shared_ffn_size:
            sinit = self.kernel_init or nn.initializers.lecun_normal()
            Fs = self.shared_ffn_size
            sg = self.param("ws_gate", part(sinit, ("embed", "mlp")), (H, Fs), self.param_dtype)
            su = self.param("ws_up", part(sinit, ("embed", "mlp")), (H, Fs), self.param_dtype)
            sd = self.param("ws_down", part(sinit, ("mlp", "embed")), (Fs, H), self.param_dtype)
            shared = (sg.astype(cdt), su.astype(cdt), sd.astype(cdt))
        bias = None
        if self.router_bias:
            bias_var = self.variable(
                BIAS_COLLECTION, "router_bias",
                part(lambda: jnp.zeros((E,), jnp.float32), ("expert",)))
            bias = jax.lax.stop_gradient(bias_var.value)
        y, aux = moe_layer(
            x.astype(cdt), router, wg.astype(cdt), wu.astype(cdt), wd.astype(cdt),
            top_k=self.top_k, score_func=self.score_func, normalize_topk=self.normalize_topk,
            router_bias=bias, routed_scaling_factor=float(self.routed_scaling_factor),
            shared_experts=shared, token_mask=token_mask, implementation=self.implementation,
            megakernel=megakernel, recompute=self.recompute, mesh=self.mesh,
            expert_axis=self.expert_axis, token_axes=self.token_axes, dispatch=self.dispatch)
        self.sow("intermediates", "aux_loss",
                 self.aux_loss_coeff * aux.load_balancing_loss
                 + self.z_loss_coeff * aux.router_z_loss)
        self.sow("intermediates", "load_balancing_loss",
                 jax.lax.stop_gradient(aux.load_balancing_loss))
        self.sow("intermediates", "router_z_loss", jax.lax.stop_gradient(aux.router_z_loss))
        self.sow("intermediates", "tokens_per_expert", aux.tokens_per_expert)
        if self.router_bias:
            self.sow("intermediates", "router_bias_update",
                     router_bias_update(aux.tokens_per_expert, self.router_bias_update_rate))
        return y


def _named_leaves(tree, name):
    """Values stored under key ``name`` anywhere in a nested dict (sow keeps a
    tuple per call; scanned layers stack them)."""
    out = []
    if isinstance(tree, dict) or hasattr(tree, "items"):
        for k, v in tree.items():
            if k == name:
                out.extend(jax.tree_util.tree_leaves(v))
            else:
                out.extend(_named_leaves(v, name))
    return out


def aux_loss(intermediates):
    """Sum of every sown ``aux_loss`` in an ``"intermediates"`` collection (all
    layers, all calls). Add it to the training loss inside the differentiated
    function."""
    return sum((jnp.sum(v) for v in _named_leaves(intermediates, "aux_loss")),
               jnp.zeros((), jnp.float32))


def apply_router_bias_updates(bias_collection, intermediates):
    """Adds each layer's sown ``router_bias_update`` to its ``router_bias``.

    Args:
      bias_collection: ``variables["moe_bias"]`` (nested dicts, possibly with
        logical-partitioning boxes and scanned ``[L, E]`` stacks).
      intermediates: the ``"intermediates"`` collection of the same call.

    Returns:
      The updated collection (same structure). A layer called several times
      gets the sum of its updates.

    Raises:
      ValueError if a router bias has no matching ``router_bias_update``.
    """
    def walk(bias, inter, path):
        out = {}
        for k, v in bias.items():
            if k == "router_bias":
                ups = [] if inter is None else list(inter.get("router_bias_update", ()))
                if not ups:
                    raise ValueError(f"no intermediates/{'/'.join(path)}/router_bias_update "
                                     "for moe_bias/" + "/".join(path + ["router_bias"]) +
                                     "; apply the model with mutable=['intermediates']")
                delta = sum(ups[1:], ups[0])
                if isinstance(v, nn.meta.AxisMetadata):
                    out[k] = v.replace_boxed(v.unbox() + delta)
                else:
                    out[k] = v + delta
            else:
                sub = None if inter is None else inter.get(k)
                out[k] = walk(v, sub, path + [k])
        return out
    return walk(bias_collection, intermediates, [])
