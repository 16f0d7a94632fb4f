"""`MegakernelConfig`: the knobs of the CUDA forward megakernel."""

from __future__ import annotations

import dataclasses

import numpy as np

# The knobs' defaults live on the C++ side only (ffi/megakernel_fwd.cuh): a
# None knob is sent as 0 and the kernels pick their default.
ROW_ALIGN = 128                 # the kernels' tile rows
MAX_DISPATCH_CTAS = 64
MAX_MINIBATCH_ROWS = 8192
MAX_RING_ROWS = 2 ** 30


@dataclasses.dataclass(frozen=True)
class MegakernelConfig:
    """How the CUDA kernels are run (``implementation="cuda"`` only).

    Every knob trades speed or memory only: the results do not depend on it
    (every token is computed whatever the ring size, the combine order is
    fixed). The CPU and ``"xla"`` implementations ignore the config. Pass it
    as ``megakernel=`` to `mok_jax.experts`, `mok_jax.moe_layer`,
    `mok_jax.experts_parallel` or the Flax modules; None there means
    ``MegakernelConfig()``.

    Attributes:
      persistent: False (default): the staged sequence of kernels (dispatch
        gather, gate/up GEMM with fused SwiGLU, down GEMM, combine), the path
        measured end to end through JAX on every benchmark shape. True: the
        forward runs as one persistent megakernel (slower today: 5.61 ms
        against the staged 5.17 ms at the Qwen3-30B-A3B shape on an H200,
        9.87 against 9.70 at Mixtral, docs/design.md),
        dispatch CTAs pulling token rows through a peer-pointer table into a
        ring buffer while compute CTAs run the expert GEMMs on the rows
        already there; the three knobs below tune it and need
        ``persistent=True``.
      persistent_backward: False (default): the backward's GEMMs run as the
        staged kernels (dgrad-down + SwiGLU backward, the weight gradients,
        dgrad gate+up), one launch each. True: they run as one persistent
        backward megakernel whose CTAs claim the same tiles from an atomic
        ticket in MoK's task order, each waiting on per-expert counters
        (no host sync); the gradients are bitwise those of the staged path
        (tested). Slower today: 12.65 ms against the staged 10.99 ms for
        the backward at the Qwen3-30B-A3B shape on an H100 through JAX,
        5-15 % slower at all four benchmark shapes (benchmarks/RESULTS.md),
        and its gathered rows always take workspace. The expert-parallel peer backward ignores it (staged).
      dispatch_ctas: CTAs that start in the dispatch role, in ``[1, 64]``;
        None = the library default (16). More pull rows faster but start
        fewer compute CTAs (they join the compute once the dispatch is done).
      minibatch_rows: rows per dispatch minibatch, the hand-over granularity
        (one ready counter each): a positive multiple of 128, at most 8192;
        None = the default (1024: the gate/up tasks of a minibatch share each
        weight tile across its 8 row tiles; halved until it divides a given
        ``ring_rows``).
      ring_rows: rows of the fixed-size ring token buffer, reused across
        macrobatches (it takes ``ring_rows * H * 2`` bytes of workspace;
        tokens beyond it are processed in further macrobatches): a positive
        multiple of 128, at most ``2**30``, and a multiple of (and at least)
        ``minibatch_rows`` when that is given; None = the default
        (``min(row capacity, 32768)``).

    Raises:
      TypeError / ValueError naming the field for a bad value.
    """

    persistent: bool = False
    dispatch_ctas: int | None = None
    minibatch_rows: int | None = None
    ring_rows: int | None = None
    persistent_backward: bool = False

    def __post_init__(self):
        for name in ("persistent", "persistent_backward"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"MegakernelConfig.{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        _check_int("dispatch_ctas", self.dispatch_ctas)
        _check_int("minibatch_rows", self.minibatch_rows)
        _check_int("ring_rows", self.ring_rows)
        if self.dispatch_ctas is not None and not 1 <= self.dispatch_ctas <= MAX_DISPATCH_CTAS:
            raise ValueError(f"MegakernelConfig.dispatch_ctas must be in [1, {MAX_DISPATCH_CTAS}], "
                             f"got {self.dispatch_ctas}")
        _check_rows("minibatch_rows", self.minibatch_rows, MAX_MINIBATCH_ROWS)
        _check_rows("ring_rows", self.ring_rows, MAX_RING_ROWS)
        if not self.persistent:
            given = [n for n in ("dispatch_ctas", "minibatch_rows", "ring_rows")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"MegakernelConfig.{given[0]} tunes the persistent megakernel: "
                                 f"pass persistent=True with it (got persistent=False)")
        mb, ring = self.minibatch_rows, self.ring_rows
        # The ring is handed over in whole minibatches.
        if mb is not None and ring is not None and (ring < mb or ring % mb):
            raise ValueError(f"MegakernelConfig.ring_rows must be a multiple of minibatch_rows "
                             f"(and at least it), got ring_rows={ring}, minibatch_rows={mb}")
        # Normalise numpy scalars so that equal configs hash (and jit-cache) equally.
        object.__setattr__(self, "persistent", bool(self.persistent))
        object.__setattr__(self, "persistent_backward", bool(self.persistent_backward))
        for name in ("dispatch_ctas", "minibatch_rows", "ring_rows"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, int(v))

    def ffi_attrs(self):
        """The FFI attributes of ``mok_experts_fwd_cuda``: int32 scalars, 0 for
        a None knob (the C++ default)."""
        return {"persistent": np.int32(1 if self.persistent else 0),
                "dispatch_ctas": np.int32(self.dispatch_ctas or 0),
                "minibatch_rows": np.int32(self.minibatch_rows or 0),
                "ring_rows": np.int32(self.ring_rows or 0)}

    def backward_ffi_attrs(self):
        """The FFI attributes of ``mok_experts_bwd_cuda``."""
        return {"persistent": np.int32(1 if self.persistent_backward else 0)}


def _check_int(name, value):
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"MegakernelConfig.{name} must be None or an int, got "
                        f"{type(value).__name__} {value!r}")


def _check_rows(name, value, maximum):
    if value is None:
        return
    if value < ROW_ALIGN or value % ROW_ALIGN:
        raise ValueError(f"MegakernelConfig.{name} must be a positive multiple of {ROW_ALIGN}, "
                         f"got {value}")
    if value > maximum:
        raise ValueError(f"MegakernelConfig.{name} must be at most {maximum}, got {value}")


def check_megakernel(megakernel):
    """The config to send (None: the defaults); TypeError naming ``megakernel``."""
    if megakernel is None:
        return None
    if not isinstance(megakernel, MegakernelConfig):
        raise TypeError("megakernel must be None or a mok_jax.MegakernelConfig, got "
                        f"{type(megakernel).__name__}")
    return megakernel
