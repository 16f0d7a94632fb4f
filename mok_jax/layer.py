"""`moe_layer`: route, then experts, in one call."""

from __future__ import annotations

from . import _validate as V
from . import parallel
from .config import check_megakernel
from .experts import experts
from .routing import route


def moe_layer(x, router_kernel, w_gate, w_up, w_down, *, top_k, score_func="softmax",
              normalize_topk=True, router_bias=None, routed_scaling_factor=1.0,
              shared_experts=None, token_mask=None, implementation="auto", mesh=None,
              expert_axis=None, token_axes=None, dispatch="auto", axis_name=None,
              megakernel=None, recompute=False):
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
        "cuda" (the Hopper kernels, bfloat16: staged, or the persistent
        megakernel, see ``megakernel``), or "auto" (the FFI kernel of the
        default backend where one applies, else "xla"). With a mesh, the
        per-rank kernel: "auto" is "cpu" on CPU devices, "cuda" on Hopper GPUs.
      megakernel: None (the defaults) or a `mok_jax.MegakernelConfig`: how the
        CUDA forward runs (persistent megakernel or staged kernels, dispatch
        CTAs, minibatch and ring sizes). Speed and memory only, never the
        result; "cpu" and "xla" ignore it.
      recompute: True re-runs the expert forward inside the backward instead
        of keeping its residuals (activation checkpointing of the experts;
        the router's few values are kept); bitwise the same gradients. The
        expert-parallel path (mesh=/axis_name=) keeps only its inputs, except
        dispatch="peer" on CUDA, which also keeps its first round's gate/up
        pre-activations unless recompute=True.
      mesh: optional `jax.sharding.Mesh` for expert parallelism (global arrays):
        w_gate/w_up/w_down are split along E over ``expert_axis``, tokens along
        T over ``token_axes``; router_kernel, router_bias and shared_experts are
        replicated. The routing itself runs outside the expert shard_map, on the
        global arrays, so aux values are global. See `mok_jax.parallel`.
      expert_axis: the mesh axis the experts are split over (required with mesh);
        E must be a multiple of its size.
      token_axes: mesh axes the tokens are split over (default: expert_axis, then
        the mesh's other axes); must include expert_axis; T must divide evenly.
      dispatch: "collective" (XLA all_to_all rounds around the local kernel),
        "peer" (mesh= only; implementation "cuda" on GPUs of one or several
        processes, or "cpu" on CPU devices of this process: each rank's
        forward and backward kernels pull their experts' rows straight from
        the owners' memory and write the results back), or "auto" ("peer"
        for the "cuda" kernels over 2 or more GPUs of one host with
        peer-to-peer access, "collective" otherwise). Without a
        mesh or axis_name there is one rank and dispatch has no effect.
      axis_name: inside your own shard_map: the expert axis. Then w_* are this
        rank's ``[E/EP, ...]`` block (expert e on rank e // (E/EP)),
        router_kernel is the full ``[H, E]``, x holds this rank's tokens, and
        the aux values are this rank's (reduce them yourself).

    Returns:
      ``(y, aux)``: y in x's shape and dtype; aux a `MoEAux`.

    Raises:
      ValueError for a bad mesh (expert_axis missing, E or T not divisible);
      NotImplementedError for dispatch="peer" with axis_name= or with mesh
      devices of several processes; TypeError for a ``megakernel``
      that is not a `mok_jax.MegakernelConfig`.
    """
    megakernel = check_megakernel(megakernel)  # before any routing work
    V.check_bool("recompute", recompute)
    if mesh is not None or axis_name is not None:
        return _moe_layer_parallel(
            x, router_kernel, w_gate, w_up, w_down, top_k=top_k, score_func=score_func,
            normalize_topk=normalize_topk, router_bias=router_bias,
            routed_scaling_factor=routed_scaling_factor, shared_experts=shared_experts,
            token_mask=token_mask, implementation=implementation, mesh=mesh,
            expert_axis=expert_axis, token_axes=token_axes, dispatch=dispatch,
            axis_name=axis_name, megakernel=megakernel, recompute=recompute)
    if expert_axis is not None or token_axes is not None:
        raise ValueError("expert_axis= and token_axes= need mesh= (or use axis_name= "
                         "inside your own shard_map)")
    parallel.check_dispatch(dispatch)
    aux = route(x, router_kernel, top_k=top_k, score_func=score_func,
                normalize_topk=normalize_topk, router_bias=router_bias,
                routed_scaling_factor=routed_scaling_factor, token_mask=token_mask)
    y = experts(x, aux.topk_ids, aux.topk_weights, w_gate, w_up, w_down,
                shared_experts=shared_experts, token_mask=token_mask,
                implementation=implementation, megakernel=megakernel, recompute=recompute)
    return y, aux


def _moe_layer_parallel(x, router_kernel, w_gate, w_up, w_down, *, top_k, score_func,
                        normalize_topk, router_bias, routed_scaling_factor, shared_experts,
                        token_mask, implementation, mesh, expert_axis, token_axes, dispatch,
                        axis_name, megakernel, recompute=False):
    import jax
    import jax.numpy as jnp
    parallel.check_dispatch(dispatch)
    if mesh is not None and axis_name is not None:
        raise ValueError("give mesh= (global arrays) or axis_name= (inside your own "
                         "shard_map), not both")
    router_kernel = jnp.asarray(router_kernel)
    w_gate = jnp.asarray(w_gate)
    E_router = router_kernel.shape[-1] if router_kernel.ndim == 2 else None
    if w_gate.ndim == 3 and E_router is not None:
        if mesh is not None and w_gate.shape[0] != E_router:
            raise ValueError(f"w_gate has E={w_gate.shape[0]} experts but router_kernel has "
                             f"{E_router}; with mesh= pass the global [E, H, F] weights")
        if axis_name is not None:
            ep = int(jax.lax.axis_size(axis_name))
            if w_gate.shape[0] * ep != E_router:
                raise ValueError(
                    f"inside shard_map, w_gate must be this rank's block of E/EP experts: "
                    f"router_kernel has E={E_router}, axis {axis_name!r} has size {ep}, "
                    f"so w_gate should have {E_router / ep:g} experts, got {w_gate.shape[0]}")
    if mesh is not None:  # fail on the mesh before any routing work
        axis, _, ep = parallel.mesh_axes(mesh, expert_axis, token_axes)
        if E_router is not None and E_router % ep:
            raise ValueError(f"w_gate has E={E_router} experts, which does not divide evenly "
                             f"over expert_axis={axis!r} of size {ep}")
    aux = route(x, router_kernel, top_k=top_k, score_func=score_func,
                normalize_topk=normalize_topk, router_bias=router_bias,
                routed_scaling_factor=routed_scaling_factor, token_mask=token_mask)
    y = parallel.experts_parallel(
        x, aux.topk_ids, aux.topk_weights, w_gate, w_up, w_down, mesh=mesh,
        expert_axis=expert_axis, token_axes=token_axes, axis_name=axis_name,
        shared_experts=shared_experts, token_mask=token_mask,
        implementation=implementation, dispatch=dispatch, megakernel=megakernel,
        recompute=recompute)
    return y, aux
