"""``python -m mok_jax.info``: what this mok_jax install can do here.

Prints the mok_jax, jax and jaxlib versions, the FFI targets that were built
and registered (cpu / cuda), the devices JAX sees (GPUs with their compute
capability), which implementation ``"auto"`` picks, and why the CUDA path is
unavailable when it is. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys

OPTIONAL_PACKAGES = ("flax", "optax", "orbax-checkpoint", "matplotlib", "torch")


def _version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuda_unavailable_reason(built, reason, gpus):
    """Why ``implementation="cuda"`` cannot run here (None when it can).

    Args:
      built: whether the CUDA module imported (`mok_jax._ffi.cuda_built`).
      reason: `mok_jax._ffi.CUDA_UNAVAILABLE_REASON` (the import error, if any).
      gpus: ``[{"compute_capability": "9.0", ...}, ...]`` for the GPUs JAX sees.
    """
    if not built:
        return reason or "the CUDA backend was not built (no nvcc at build time, or MOK_JAX_CUDA=OFF)"
    if not gpus:
        return ("the CUDA backend is built but JAX sees no GPU (install jax[cuda13] / "
                "jax-cuda13-plugin, and check CUDA_VISIBLE_DEVICES)")
    if not any(str(g.get("compute_capability", "")).startswith("9.0") for g in gpus):
        ccs = ", ".join(str(g.get("compute_capability")) for g in gpus)
        return (f"the CUDA kernels are built for sm_90a (Hopper: H100/H200) only; "
                f"this GPU has compute capability {ccs}")
    return None


def cuda_build_options():
    """The CUDA module's compile-time variants ({} when it is not built): e.g.
    gemm_tma_store, the GEMMs' TMA-store epilogues (MOK_JAX_GEMM_TMA_STORE=ON)."""
    from mok_jax import _ffi
    if not _ffi.cuda_built():
        return {}
    return dict(_ffi._mok_cuda.build_options())


def collect():
    """The information as a dict (JSON-serialisable)."""
    import jax
    import mok_jax
    from mok_jax import _ffi
    from mok_jax.experts import resolve_implementation

    cpu_targets = sorted(_ffi._mok_cpu.registrations())
    cuda_targets = sorted(_ffi._mok_cuda.registrations()) if _ffi.cuda_built() else []
    try:
        gpu_devices = jax.devices("gpu")
    except RuntimeError:
        gpu_devices = []
    gpus = [{"id": d.id, "kind": d.device_kind,
             "compute_capability": str(getattr(d, "compute_capability", "unknown"))}
            for d in gpu_devices]
    reason = cuda_unavailable_reason(_ffi.cuda_built(), _ffi.CUDA_UNAVAILABLE_REASON, gpus)
    auto = {}
    for dt in ("float32", "bfloat16"):
        try:
            auto[dt] = resolve_implementation("auto", jax.numpy.dtype(dt))
        except Exception as err:  # pragma: no cover - defensive
            auto[dt] = f"error: {err}"
    return {
        "mok_jax": mok_jax.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "default_backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "ffi": {
            "cpu": {"built": True, "registered": cpu_targets, "tile_rows": _ffi.TILE_ROWS},
            "cuda": {"built": _ffi.cuda_built(), "registered": cuda_targets,
                     "build_options": cuda_build_options()},
        },
        "gpus": gpus,
        "cuda_usable": reason is None,
        "cuda_unavailable_reason": reason,
        "auto_implementation": auto,
        "optional_packages": {p: _version(p) for p in OPTIONAL_PACKAGES},
    }


def format_info(info):
    """A human-readable report of `collect`'s dict."""
    ffi = info["ffi"]
    lines = [
        f"mok_jax {info['mok_jax']}  (python {info['python']}, {info['platform']})",
        f"jax {info['jax']}, jaxlib {info['jaxlib']}; default backend: {info['default_backend']}",
        f"devices: {', '.join(info['devices'])}",
        f"FFI cpu : built, registered: {', '.join(ffi['cpu']['registered'])}",
    ]
    if ffi["cuda"]["built"]:
        lines.append(f"FFI cuda: built, registered: {', '.join(ffi['cuda']['registered'])}")
        opts = ffi["cuda"].get("build_options") or {}
        if opts:
            lines.append("FFI cuda build options: " + ", ".join(f"{k}={v}" for k, v in sorted(opts.items())))
    else:
        lines.append("FFI cuda: not built")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"GPU {g['id']}: {g['kind']}, compute capability {g['compute_capability']}")
    else:
        lines.append("GPU: none visible to JAX")
    if info["cuda_usable"]:
        lines.append("CUDA path: available (implementation='cuda', bfloat16)")
    else:
        lines.append(f"CUDA path: unavailable: {info['cuda_unavailable_reason']}")
    auto = info["auto_implementation"]
    lines.append(f"implementation='auto' picks: float32 -> {auto['float32']}, "
                 f"bfloat16 -> {auto['bfloat16']}")
    opt = ", ".join(f"{k} {v or '-'}" for k, v in info["optional_packages"].items())
    lines.append(f"optional packages: {opt}")
    return "\n".join(lines)


def main(argv=None):
    """Entry point of ``python -m mok_jax.info [--json]``."""
    p = argparse.ArgumentParser(prog="python -m mok_jax.info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = p.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else format_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
