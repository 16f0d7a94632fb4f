"""Weight converters between the layouts users already have and mok_jax's.

mok_jax stores the routed experts in-major, stacked over experts:
``w_gate, w_up: [E, H, F]``, ``w_down: [E, F, H]``, and the router as
``router_kernel: [H, E]`` (the parameter names of `mok_jax.nnx.MoE` /
`mok_jax.linen.MoE`).

Sources handled:

- Hugging Face Mixtral, Qwen3-MoE (and Qwen2-MoE-style shared experts),
  DeepSeek-V3: one ``nn.Linear`` per expert, PyTorch's ``[out, in]`` layout:
  ``gate_proj``/``up_proj`` ``[F, H]``, ``down_proj`` ``[H, F]`` (Mixtral names
  them ``w1``/``w3``/``w2``), router ``gate.weight`` ``[E, H]``; DeepSeek-V3's
  ``gate.e_score_correction_bias`` ``[E]`` is mok_jax's selection-only
  ``router_bias``. See `experts_from_hf`, `from_hf_state_dict`.
- Megatron-Core grouped experts: ``TEGroupedMLP`` (``linear_fc1.weight{e}``
  ``[2F, H]`` with gate rows first, ``linear_fc2.weight{e}`` ``[H, F]``) and the
  legacy ``GroupedMLP`` (``weight1`` ``[H, E*2F]``, ``weight2`` ``[E*F, H]``).
  See `experts_from_megatron`.

Every function has an inverse (``*_to_*``) and is exact (pure transposes,
reshapes and stacking, no arithmetic). Arrays may be NumPy or JAX arrays (the
result is of the same kind); for PyTorch tensors pass ``t.float().numpy()``
(or ``t.view(torch.int16).numpy()`` viewed back as bfloat16 to keep bf16 bits).
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import numpy as np

__all__ = ["experts_from_hf", "experts_to_hf", "router_from_hf", "router_to_hf",
           "experts_from_megatron", "experts_to_megatron", "from_hf_state_dict",
           "to_hf_state_dict", "HF_STYLES", "assign"]


def _xp(*arrays):
    """numpy for host arrays, jax.numpy if any input is a jax.Array."""
    try:
        import jax
        if any(isinstance(a, jax.Array) for a in arrays):
            import jax.numpy as jnp
            return jnp
    except ImportError:  # pragma: no cover
        pass
    return np


def _check(name, a, rank, layout):
    if not hasattr(a, "shape") or len(a.shape) != rank:
        raise ValueError(f"{name} must be a rank-{rank} array {layout}, got "
                         f"{getattr(a, 'shape', type(a).__name__)}")


def experts_from_hf(gate_proj: Sequence, up_proj: Sequence, down_proj: Sequence):
    """Per-expert ``nn.Linear`` weights (``[out, in]``) -> mok_jax stacks.

    Args:
      gate_proj, up_proj: E arrays ``[F, H]`` (Mixtral: ``w1``, ``w3``).
      down_proj: E arrays ``[H, F]`` (Mixtral: ``w2``).

    Returns:
      ``(w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H])``.

    Raises:
      ValueError naming the argument on a count or shape mismatch.
    """
    E = len(gate_proj)
    if E == 0:
        raise ValueError("gate_proj is empty: expected one [F, H] array per expert")
    for name, lst in (("up_proj", up_proj), ("down_proj", down_proj)):
        if len(lst) != E:
            raise ValueError(f"{name} has {len(lst)} experts, gate_proj has {E}")
    F, H = gate_proj[0].shape
    for e in range(E):
        for name, a, shape in (("gate_proj", gate_proj[e], (F, H)), ("up_proj", up_proj[e], (F, H)),
                               ("down_proj", down_proj[e], (H, F))):
            if tuple(a.shape) != shape:
                raise ValueError(f"{name}[{e}] has shape {tuple(a.shape)}, expected {shape} "
                                 "(PyTorch nn.Linear [out, in])")
    xp = _xp(*gate_proj, *up_proj, *down_proj)
    w_gate = xp.stack([xp.asarray(a).T for a in gate_proj])
    w_up = xp.stack([xp.asarray(a).T for a in up_proj])
    w_down = xp.stack([xp.asarray(a).T for a in down_proj])
    return w_gate, w_up, w_down


def experts_to_hf(w_gate, w_up, w_down):
    """mok_jax stacks -> per-expert ``[out, in]`` lists (inverse of `experts_from_hf`).

    Returns:
      ``(gate_proj, up_proj, down_proj)``: lists of E arrays ``[F, H]``,
      ``[F, H]``, ``[H, F]``.
    """
    _check("w_gate", w_gate, 3, "[E, H, F]")
    E, H, F = w_gate.shape
    if tuple(w_up.shape) != (E, H, F):
        raise ValueError(f"w_up has shape {tuple(w_up.shape)}, expected {(E, H, F)}")
    if tuple(w_down.shape) != (E, F, H):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected {(E, F, H)}")
    return ([w_gate[e].T for e in range(E)], [w_up[e].T for e in range(E)],
            [w_down[e].T for e in range(E)])


def router_from_hf(gate_weight):
    """HF router ``gate.weight`` ``[E, H]`` -> ``router_kernel`` ``[H, E]``."""
    _check("gate_weight", gate_weight, 2, "[E, H]")
    return gate_weight.T


def router_to_hf(router_kernel):
    """``router_kernel`` ``[H, E]`` -> HF ``gate.weight`` ``[E, H]``."""
    _check("router_kernel", router_kernel, 2, "[H, E]")
    return router_kernel.T


def experts_from_megatron(fc1, fc2, *, num_experts=None, hidden_size=None):
    """Megatron-Core grouped experts (SwiGLU, gate rows first) -> mok_jax stacks.

    Args:
      fc1, fc2: either ``TEGroupedMLP`` lists (``linear_fc1.weight{e}``: E
        arrays ``[2F, H]``; ``linear_fc2.weight{e}``: E arrays ``[H, F]``), or the
        legacy ``GroupedMLP`` tensors ``weight1`` ``[H, E*2F]`` and ``weight2``
        ``[E*F, H]`` (then ``num_experts`` is required).
      num_experts: E, for the legacy layout.
      hidden_size: optional H to check against.

    Returns:
      ``(w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H])``.

    Megatron's ``moe_mlp_glu_interleave_size`` (block-interleaved gate/up) is
    not handled: de-interleave first.
    """
    if isinstance(fc1, (list, tuple)):
        E = len(fc1)
        if E == 0 or len(fc2) != E:
            raise ValueError(f"fc1 has {E} experts and fc2 {len(fc2)}: expected the same E >= 1")
        two_f, H = fc1[0].shape
        if two_f % 2:
            raise ValueError(f"fc1[0] has shape {tuple(fc1[0].shape)}; axis 0 must be 2F "
                             "(gate rows, then up rows)")
        F = two_f // 2
        for e in range(E):
            if tuple(fc1[e].shape) != (2 * F, H):
                raise ValueError(f"fc1[{e}] has shape {tuple(fc1[e].shape)}, expected {(2 * F, H)}")
            if tuple(fc2[e].shape) != (H, F):
                raise ValueError(f"fc2[{e}] has shape {tuple(fc2[e].shape)}, expected {(H, F)}")
        xp = _xp(*fc1, *fc2)
        w13 = xp.stack([xp.asarray(a).T for a in fc1])            # [E, H, 2F]
        w_down = xp.stack([xp.asarray(a).T for a in fc2])         # [E, F, H]
    else:
        if num_experts is None:
            raise ValueError("num_experts is required for the legacy GroupedMLP layout "
                             "(weight1 [H, E*2F], weight2 [E*F, H])")
        _check("fc1", fc1, 2, "[H, E*2F] (GroupedMLP weight1)")
        _check("fc2", fc2, 2, "[E*F, H] (GroupedMLP weight2)")
        E = num_experts
        H, cols = fc1.shape
        if cols % (2 * E):
            raise ValueError(f"fc1 has shape {tuple(fc1.shape)}; axis 1 must be E*2F with E={E}")
        F = cols // (2 * E)
        if tuple(fc2.shape) != (E * F, H):
            raise ValueError(f"fc2 has shape {tuple(fc2.shape)}, expected {(E * F, H)}")
        # Megatron views weight1 as [E, H, 2F] and weight2 as [E, F, H] (row-major).
        w13 = fc1.reshape(E, H, 2 * F)
        w_down = fc2.reshape(E, F, H)
    if hidden_size is not None and H != hidden_size:
        raise ValueError(f"the Megatron weights have H={H}, expected hidden_size={hidden_size}")
    return w13[..., :F], w13[..., F:], w_down


def experts_to_megatron(w_gate, w_up, w_down, *, layout="te"):
    """mok_jax stacks -> Megatron-Core grouped experts (inverse of `experts_from_megatron`).

    Args:
      layout: "te" (``TEGroupedMLP``: returns lists of E ``[2F, H]`` and E
        ``[H, F]`` arrays) or "legacy" (``GroupedMLP``: returns ``weight1``
        ``[H, E*2F]`` and ``weight2`` ``[E*F, H]``).
    """
    _check("w_gate", w_gate, 3, "[E, H, F]")
    E, H, F = w_gate.shape
    if tuple(w_up.shape) != (E, H, F) or tuple(w_down.shape) != (E, F, H):
        raise ValueError(f"w_up {tuple(w_up.shape)} / w_down {tuple(w_down.shape)} do not match "
                         f"w_gate [E, H, F] = {(E, H, F)}")
    xp = _xp(w_gate, w_up, w_down)
    w13 = xp.concatenate([w_gate, w_up], axis=-1)                # [E, H, 2F]
    if layout == "te":
        return [w13[e].T for e in range(E)], [w_down[e].T for e in range(E)]
    if layout == "legacy":
        # the inverse of Megatron's weight1.view(E, H, -1) / weight2.view(E, -1, H)
        return xp.reshape(w13, (H, E * 2 * F)), xp.reshape(w_down, (E * F, H))
    raise ValueError(f"layout={layout!r} is not supported; expected 'te' or 'legacy'")


#: Hugging Face parameter names per model family, relative to a decoder layer.
HF_STYLES: Dict[str, dict] = {
    "mixtral": dict(block="block_sparse_moe.", router="gate.weight", experts="experts.{e}.",
                    gate="w1.weight", up="w3.weight", down="w2.weight"),
    "qwen3_moe": dict(block="mlp.", router="gate.weight", experts="experts.{e}.",
                      gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight"),
    "qwen2_moe": dict(block="mlp.", router="gate.weight", experts="experts.{e}.",
                      gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight",
                      shared="shared_expert."),
    "deepseek_v3": dict(block="mlp.", router="gate.weight", experts="experts.{e}.",
                        gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight",
                        bias="gate.e_score_correction_bias", shared="shared_experts."),
}


def _style(style):
    if style not in HF_STYLES:
        raise ValueError(f"style={style!r} is not supported; expected one of {tuple(HF_STYLES)}")
    return HF_STYLES[style]


def from_hf_state_dict(state_dict: Mapping, *, layer_prefix: str, num_experts: int,
                       style: str = "qwen3_moe") -> Dict[str, object]:
    """One decoder layer's MoE weights from a Hugging Face state dict.

    Args:
      state_dict: name -> array (NumPy/JAX), e.g. from ``safetensors.numpy.load_file``.
      layer_prefix: the layer's prefix, e.g. ``"model.layers.3."``.
      num_experts: E.
      style: a key of `HF_STYLES` ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3").

    Returns:
      A dict with mok_jax's parameter names: ``router_kernel``, ``w_gate``,
      ``w_up``, ``w_down``, plus ``router_bias`` (DeepSeek-V3) and ``ws_gate``,
      ``ws_up``, ``ws_down`` ``[H, Fs]``/``[Fs, H]`` when the layer has a shared expert.

    Raises:
      KeyError naming the missing parameter.

    Qwen2-MoE's ``shared_expert_gate`` (a sigmoid gate on the shared output) has
    no mok_jax equivalent and is rejected.
    """
    s = _style(style)
    base = layer_prefix + s["block"]

    def get(name):
        if name not in state_dict:
            raise KeyError(f"{name!r} is not in state_dict (style={style!r}, "
                           f"layer_prefix={layer_prefix!r})")
        return state_dict[name]

    ex = [base + s["experts"].format(e=e) for e in range(num_experts)]
    w_gate, w_up, w_down = experts_from_hf([get(p + s["gate"]) for p in ex],
                                           [get(p + s["up"]) for p in ex],
                                           [get(p + s["down"]) for p in ex])
    out = {"router_kernel": router_from_hf(get(base + s["router"])),
           "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    if s.get("bias") and base + s["bias"] in state_dict:
        out["router_bias"] = state_dict[base + s["bias"]]
    if s.get("shared") and base + s["shared"] + "gate_proj.weight" in state_dict:
        if base + "shared_expert_gate.weight" in state_dict:
            raise ValueError(f"{base}shared_expert_gate.weight: a gated shared expert is not "
                             "supported by mok_jax")
        sp = base + s["shared"]
        out["ws_gate"] = get(sp + "gate_proj.weight").T
        out["ws_up"] = get(sp + "up_proj.weight").T
        out["ws_down"] = get(sp + "down_proj.weight").T
    return out


def to_hf_state_dict(params: Mapping, *, layer_prefix: str,
                     style: str = "qwen3_moe") -> Dict[str, object]:
    """The inverse of `from_hf_state_dict`: mok_jax parameters -> HF names and layouts."""
    s = _style(style)
    base = layer_prefix + s["block"]
    for name in ("router_kernel", "w_gate", "w_up", "w_down"):
        if name not in params:
            raise KeyError(f"params has no {name!r}")
    gates, ups, downs = experts_to_hf(params["w_gate"], params["w_up"], params["w_down"])
    out = {base + s["router"]: router_to_hf(params["router_kernel"])}
    for e, (g, u, d) in enumerate(zip(gates, ups, downs)):
        p = base + s["experts"].format(e=e)
        out[p + s["gate"]], out[p + s["up"]], out[p + s["down"]] = g, u, d
    if "router_bias" in params and params["router_bias"] is not None:
        if not s.get("bias"):
            raise ValueError(f"style={style!r} has no router bias parameter")
        out[base + s["bias"]] = params["router_bias"]
    if params.get("ws_gate") is not None:
        if not s.get("shared"):
            raise ValueError(f"style={style!r} has no shared expert")
        sp = base + s["shared"]
        out[sp + "gate_proj.weight"] = params["ws_gate"].T
        out[sp + "up_proj.weight"] = params["ws_up"].T
        out[sp + "down_proj.weight"] = params["ws_down"].T
    return out


def assign(module, params: Mapping):
    """Copies converted weights into a `mok_jax.nnx.MoE` in place, cast to each
    variable's dtype (e.g. bf16 experts, fp32 router).

    Raises:
      ValueError naming the parameter on a shape mismatch or an unknown name.
    """
    import jax.numpy as jnp
    from . import nnx as mnnx
    for name, value in params.items():
        var = getattr(module, name, None)
        if var is None:
            raise ValueError(f"the module has no {name!r} (router_bias needs router_bias=True, "
                             "ws_* need shared_ffn_size)")
        old = mnnx._get(var)
        if tuple(old.shape) != tuple(value.shape):
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the module expects "
                             f"{tuple(old.shape)}")
        mnnx._set(var, jnp.asarray(value, old.dtype))
