"""Flax NNX module for the mok_jax MoE layer: ``mok_jax.nnx.MoE``.

A thin wrapper over `mok_jax.moe_layer`: the module owns the parameters (with
logical axis names for sharding rules), an optional non-trainable router bias
for aux-loss-free balancing, and stores the auxiliary losses and the expert
load of its last call in non-trainable variables, so they survive `nnx.jit`,
`nnx.remat` and `nnx.scan` and can be collected with `aux_loss` /
`expert_load`.

Example::

    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import mok_jax.nnx

    moe = mok_jax.nnx.MoE(hidden_size=64, ffn_size=128, num_experts=8, top_k=2,
                          aux_loss_coeff=1e-2, rngs=nnx.Rngs(0))
    y = moe(jnp.ones((4, 16, 64), jnp.bfloat16))          # [4, 16, 64] bfloat16
    loss_extra = mok_jax.nnx.aux_loss(moe)                # coeff-weighted losses

Requires flax (``pip install 'mok_jax[flax]'``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from . import _validate as V
from . import parallel
from .config import MegakernelConfig, check_megakernel
from .layer import moe_layer

__all__ = ["MoE", "RouterBias", "MoEAuxLoss", "MoEStats", "aux_loss", "expert_load",
           "update_router_biases", "router_bias_update", "EXPERT_KERNEL_AXES",
           "EXPERT_DOWN_AXES", "ROUTER_AXES"]

#: Logical axis names of ``w_gate`` / ``w_up`` ``[E, H, F]``.
EXPERT_KERNEL_AXES = ("expert", "embed", "mlp")
#: Logical axis names of ``w_down`` ``[E, F, H]``.
EXPERT_DOWN_AXES = ("expert", "mlp", "embed")
#: Logical axis names of the router kernel ``[H, E]``.
ROUTER_AXES = ("embed", "expert")
_SHARED_IN_AXES = ("embed", "mlp")
_SHARED_OUT_AXES = ("mlp", "embed")


class RouterBias(nnx.Variable):
    """The aux-loss-free router bias ``[E]`` (float32): selection only, not a
    `nnx.Param`, so optimisers built with ``wrt=nnx.Param`` leave it alone.
    It is changed only by `MoE.update_router_bias` / `update_router_biases`."""


class MoEAuxLoss(nnx.Variable):
    """The coefficient-weighted auxiliary loss of a layer's last call
    (``aux_loss_coeff * load_balancing_loss + z_loss_coeff * router_z_loss``),
    a float32 scalar; `aux_loss` sums them over a model."""


class MoEStats(nnx.Variable):
    """Unweighted statistics of a layer's last call, for logging and the
    router-bias update: ``tokens_per_expert`` ``[E]`` int32,
    ``load_balancing_loss`` and ``router_z_loss`` (float32 scalars)."""


def router_bias_update(tokens_per_expert, rate):
    """The aux-loss-free update ``rate * sign(mean_load - load)`` (DeepSeek-V3).

    Args:
      tokens_per_expert: ``[..., E]`` routed (token, k) pairs per expert (any
        leading axes, e.g. a stack of scanned layers, are kept).
      rate: the update rate (Megatron-Core ``moe_router_bias_update_rate``,
        MaxText ``routed_bias_update_rate``).

    Returns:
      float32 ``[..., E]``: add it to the router bias. Underloaded experts go up,
      overloaded ones down; it carries no gradient.
    """
    load = jax.lax.stop_gradient(jnp.asarray(tokens_per_expert)).astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return jnp.float32(rate) * jnp.sign(mean - load)


def _check_positive_int(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")


def check_config(*, hidden_size, ffn_size, num_experts, top_k, shared_ffn_size, score_func,
                 implementation, aux_loss_coeff, z_loss_coeff, router_bias_update_rate,
                 dtype, param_dtype):
    """Validates a module configuration (shared by the NNX and Linen modules);
    raises ValueError/TypeError naming the offending argument."""
    if hidden_size is not None:
        _check_positive_int("hidden_size", hidden_size)
    _check_positive_int("ffn_size", ffn_size)
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("shared_ffn_size", shared_ffn_size, minimum=0)
    V.check_top_k(top_k, num_experts)
    V.check_choice("score_func", score_func, V.SCORE_FUNCS)
    V.check_choice("implementation", implementation, V.IMPLEMENTATIONS)
    for name, v in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff),
                    ("router_bias_update_rate", router_bias_update_rate)):
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name}={v!r} must be a non-negative Python number")
    allowed = [jnp.dtype(d) for d in V.FLOAT_DTYPES]
    if jnp.dtype(param_dtype) not in allowed:
        raise TypeError(f"param_dtype={param_dtype} is not supported; expected float32 or bfloat16")
    if dtype is not None and jnp.dtype(dtype) not in allowed:
        raise TypeError(f"dtype={dtype} is not supported; expected None, float32 or bfloat16")


def compute_dtype(dtype, x_dtype, param_dtype):
    """Flax's rule: an explicit ``dtype``, else the promotion of x's and the params' dtypes."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.promote_types(x_dtype, param_dtype)


def default_kernel_init():
    """Expert kernels: fan-in scaled truncated normal over the contracted axis
    (axis -2 of ``[E, H, F]`` / ``[E, F, H]``), experts as a batch axis."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=-2, out_axis=-1, batch_axis=(0,))


def _mesh_active():
    try:
        return not jax.sharding.get_abstract_mesh().empty
    except Exception:  # very old jax without abstract meshes
        return False


def _annotated(cls, boxed):
    """Builds a Variable carrying logical axis names. Flax >= 0.12 shards such
    variables eagerly, which needs a mesh; without one the names are kept as
    metadata only (what `nnx.get_partition_spec` and sharding rules read)."""
    if hasattr(nnx, "use_eager_sharding") and not _mesh_active():
        return cls(boxed, eager_sharding=False)
    return cls(boxed)


class MoE(nnx.Module):
    """A dropless mixture-of-experts SwiGLU layer (Flax NNX) over `mok_jax.moe_layer`.

    ``y = sum_k w_k * down_e(silu(x @ gate_e) * (x @ up_e)) + shared(x)`` over each
    token's ``top_k`` experts, no token dropped (capacity is unbounded).

    Args:
      hidden_size: H, the model width (x's last axis).
      ffn_size: F, each routed expert's intermediate size.
      num_experts: E.
      top_k: experts per token, in ``[1, E]``.
      shared_ffn_size: Fs of an always-on shared expert (0: none). Several shared
        experts are one of the summed size.
      score_func: "softmax" or "sigmoid".
      normalize_topk: renormalise the chosen scores to sum to 1.
      routed_scaling_factor: multiplies the combine weights.
      dtype: compute dtype of the experts (None: promote x's and param_dtype).
      param_dtype: dtype of the expert (and shared-expert) kernels, default bfloat16.
      router_dtype: dtype of the router kernel, default float32 (the router math
        is float32 whatever it is).
      kernel_init: initialiser of the expert kernels (called with ``[E, H, F]``
        / ``[E, F, H]`` shapes) and the shared expert's.
      router_init: initialiser of the router kernel ``[H, E]``.
      router_bias: if True, keep a `RouterBias` ``[E]`` (zeros) added to the
        scores for selection only (DeepSeek-V3 aux-loss-free balancing);
        update it outside the gradient with `update_router_bias`.
      router_bias_update_rate: the rate of that update.
      aux_loss_coeff: weight of the Switch load-balancing loss in `MoEAuxLoss`.
      z_loss_coeff: weight of the router z-loss in `MoEAuxLoss`.
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
      rngs: `nnx.Rngs` for the initialisers (its ``params`` stream).

    Attributes:
      router_kernel, w_gate, w_up, w_down (and ws_gate, ws_up, ws_down with a
      shared expert): `nnx.Param`s with logical axis names in their metadata
      (``EXPERT_KERNEL_AXES``, ``EXPERT_DOWN_AXES``, ``ROUTER_AXES``).
      router_bias: a `RouterBias` or None. aux_loss: a `MoEAuxLoss`.
      tokens_per_expert, load_balancing_loss, router_z_loss: `MoEStats`.

    Raises:
      ValueError / TypeError naming the argument for a bad configuration, and
      from `__call__` for a bad input (see `mok_jax.moe_layer`).

    Without ``mesh``, under logical-axis sharding rules the weights are
    stored sharded and XLA gathers what the layer needs; with ``mesh``, the
    layer runs expert-parallel (tokens exchanged between the expert shards).
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
                 shared_ffn_size: int = 0, score_func: str = "softmax",
                 normalize_topk: bool = True, routed_scaling_factor: float = 1.0,
                 dtype: Optional[Any] = None, param_dtype: Any = jnp.bfloat16,
                 router_dtype: Any = jnp.float32,
                 kernel_init: Optional[Callable] = None,
                 router_init: Optional[Callable] = None,
                 router_bias: bool = False, router_bias_update_rate: float = 1e-3,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 implementation: str = "auto",
                 megakernel: Optional[MegakernelConfig] = None, recompute: bool = False,
                 mesh: Optional[Any] = None, expert_axis: Optional[str] = None,
                 token_axes: Optional[Any] = None, dispatch: str = "auto",
                 rngs: nnx.Rngs):
        check_config(hidden_size=hidden_size, ffn_size=ffn_size, num_experts=num_experts,
                     top_k=top_k, shared_ffn_size=shared_ffn_size, score_func=score_func,
                     implementation=implementation, aux_loss_coeff=aux_loss_coeff,
                     z_loss_coeff=z_loss_coeff, router_bias_update_rate=router_bias_update_rate,
                     dtype=dtype, param_dtype=param_dtype)
        H, F, E = hidden_size, ffn_size, num_experts
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = H, F, E, top_k
        self.shared_ffn_size = shared_ffn_size
        self.score_func, self.normalize_topk = score_func, normalize_topk
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.dtype, self.param_dtype, self.router_dtype = dtype, param_dtype, router_dtype
        self.router_bias_update_rate = float(router_bias_update_rate)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.implementation = implementation
        # A static (hashable) attribute, not a Variable: it is part of the graph def.
        self.megakernel = check_megakernel(megakernel)
        self.recompute = V.check_bool("recompute", recompute)
        # Static too: the mesh and its axes pick the expert-parallel path.
        self.mesh, self.expert_axis, self.dispatch = mesh, expert_axis, dispatch
        self.token_axes = tuple(token_axes) if isinstance(token_axes, (list, tuple)) else token_axes
        parallel.check_dispatch(dispatch)
        kinit = kernel_init or default_kernel_init()
        rinit = router_init or jax.nn.initializers.lecun_normal()

        def param(init, shape, dtype, axes, cls=nnx.Param):
            return _annotated(cls, nnx.with_partitioning(init, axes)(rngs.params(), shape, dtype))

        self.router_kernel = param(rinit, (H, E), router_dtype, ROUTER_AXES)
        self.w_gate = param(kinit, (E, H, F), param_dtype, EXPERT_KERNEL_AXES)
        self.w_up = param(kinit, (E, H, F), param_dtype, EXPERT_KERNEL_AXES)
        self.w_down = param(kinit, (E, F, H), param_dtype, EXPERT_DOWN_AXES)
        if shared_ffn_size:
            sinit = kernel_init or jax.nn.initializers.lecun_normal()
            Fs = shared_ffn_size
            self.ws_gate = param(sinit, (H, Fs), param_dtype, _SHARED_IN_AXES)
            self.ws_up = param(sinit, (H, Fs), param_dtype, _SHARED_IN_AXES)
            self.ws_down = param(sinit, (Fs, H), param_dtype, _SHARED_OUT_AXES)
        else:
            self.ws_gate = self.ws_up = self.ws_down = None
        if router_bias:
            self.router_bias = param(jax.nn.initializers.zeros, (E,), jnp.float32, ("expert",),
                                     RouterBias)
        else:
            self.router_bias = None
        self.aux_loss = MoEAuxLoss(jnp.zeros((), jnp.float32))
        self.tokens_per_expert = MoEStats(jnp.zeros((E,), jnp.int32))
        self.load_balancing_loss = MoEStats(jnp.zeros((), jnp.float32))
        self.router_z_loss = MoEStats(jnp.zeros((), jnp.float32))

    def __call__(self, x, token_mask=None, *, return_aux: bool = False):
        """Applies the layer.

        Args:
          x: ``[..., hidden_size]`` tokens (float32 or bfloat16).
          token_mask: optional bool ``[...]`` (x's shape without the last axis):
            False marks padding tokens; they are not dispatched, their output is
            zero and they count in no loss nor load.
          return_aux: also return the raw `mok_jax.MoEAux`.

        Returns:
          ``y`` (``[..., hidden_size]`` in the compute dtype), or ``(y, aux)``
          with ``return_aux=True``. Either way the weighted aux loss and the
          statistics are stored in ``self.aux_loss`` and the `MoEStats`.
        """
        x = jnp.asarray(x)
        if x.ndim < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x has shape {tuple(x.shape)}; its last axis must be "
                             f"hidden_size={self.hidden_size}")
        V.check_float("x", x)
        cdt = compute_dtype(self.dtype, x.dtype, self.param_dtype)
        cast = lambda p: jnp.asarray(_get(p)).astype(cdt)
        shared = None
        if self.ws_gate is not None:
            shared = (cast(self.ws_gate), cast(self.ws_up), cast(self.ws_down))
        bias = None if self.router_bias is None else jax.lax.stop_gradient(_get(self.router_bias))
        y, aux = moe_layer(
            x.astype(cdt), _get(self.router_kernel), cast(self.w_gate), cast(self.w_up),
            cast(self.w_down), top_k=self.top_k, score_func=self.score_func,
            normalize_topk=self.normalize_topk, router_bias=bias,
            routed_scaling_factor=self.routed_scaling_factor, shared_experts=shared,
            token_mask=token_mask, implementation=self.implementation,
            megakernel=self.megakernel, recompute=self.recompute, mesh=self.mesh,
            expert_axis=self.expert_axis, token_axes=self.token_axes, dispatch=self.dispatch)
        _set(self.aux_loss, self.aux_loss_coeff * aux.load_balancing_loss
             + self.z_loss_coeff * aux.router_z_loss)
        _set(self.tokens_per_expert, aux.tokens_per_expert)
        _set(self.load_balancing_loss, jax.lax.stop_gradient(aux.load_balancing_loss))
        _set(self.router_z_loss, jax.lax.stop_gradient(aux.router_z_loss))
        return (y, aux) if return_aux else y

    def update_router_bias(self, tokens_per_expert=None):
        """Applies ``router_bias += rate * sign(mean_load - load)`` in place.

        Call it outside the gradient, e.g. after the optimiser step.

        Args:
          tokens_per_expert: the load ``[E]`` (or ``[L, E]`` for a scanned stack)
            to balance; default: the load stored by the last call.

        Raises:
          ValueError if the module was built without ``router_bias=True``.
        """
        if self.router_bias is None:
            raise ValueError("update_router_bias needs a module built with router_bias=True")
        load = _get(self.tokens_per_expert) if tokens_per_expert is None else tokens_per_expert
        _set(self.router_bias, _get(self.router_bias) + router_bias_update(
            load, self.router_bias_update_rate))


def _get(var):
    """A Variable's value across flax versions (``.value`` is deprecated in 0.12)."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set(var, value):
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:
        var.value = value


def _moe_modules(model):
    if isinstance(model, MoE):
        return [model]
    iterate = getattr(nnx, "iter_modules", None)
    pairs = iterate(model) if iterate is not None else model.iter_modules()
    return [m for _, m in pairs if isinstance(m, MoE)]


def aux_loss(model):
    """Sum of the `MoEAuxLoss` of every `MoE` in ``model`` from their last call
    (a scanned stack contributes all its layers). Add it to the training loss
    inside the differentiated function."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model, MoEAuxLoss))
    return sum((jnp.sum(leaf) for leaf in leaves), jnp.zeros((), jnp.float32))


def expert_load(model):
    """The ``tokens_per_expert`` of every `MoE` in ``model`` from their last
    call, as a list of arrays (``[E]``, or ``[L, E]`` for a scanned stack)."""
    return [_get(m.tokens_per_expert) for m in _moe_modules(model)]


def update_router_biases(model):
    """`MoE.update_router_bias` on every `MoE` of ``model`` that has a router
    bias (outside the gradient, after the optimiser step). Returns the number
    of modules updated."""
    n = 0
    for m in _moe_modules(model):
        if m.router_bias is not None:
            m.update_router_bias()
            n += 1
    return n
