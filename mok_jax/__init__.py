"""mok_jax: a fused, dropless MoE layer for JAX through the XLA FFI.

Public API: `moe_layer`, `route`, `experts`, `MoEAux`. See README.md.
"""

from ._ffi import cuda_built
from .experts import experts
from .layer import moe_layer
from .routing import MoEAux, route

__version__ = "0.1.0"
__all__ = ["moe_layer", "route", "experts", "MoEAux", "cuda_built", "__version__"]
