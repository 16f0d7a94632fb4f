"""mok_jax: a fused, dropless MoE layer for JAX through the XLA FFI.

Public API: `moe_layer`, `route`, `experts`, `MoEAux`, `MegakernelConfig`.
See README.md.
"""

from ._ffi import cuda_built
from .config import MegakernelConfig
from .experts import experts
from .layer import moe_layer
from .routing import MoEAux, route

__version__ = "0.1.0"
__all__ = ["moe_layer", "route", "experts", "MoEAux", "MegakernelConfig", "cuda_built",
           "__version__"]

# Flax modules and the weight converters load on first access
# (`mok_jax.nnx`, `mok_jax.linen`, `mok_jax.convert`, `mok_jax.info`), so that
# `import mok_jax` never imports flax.
_LAZY_SUBMODULES = ("nnx", "linen", "convert", "info")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Expert parallelism at the `experts` level (moe_layer takes mesh=/axis_name=).
from .parallel import experts_parallel  # noqa: E402

__all__.append("experts_parallel")
