"""python -m mok_jax.info: the report agrees with what is actually loaded."""

import json
import os
import subprocess
import sys

import jax

import mok_jax
from mok_jax import _ffi, info


def test_collect_matches_the_loaded_backends():
    d = info.collect()
    assert d["mok_jax"] == mok_jax.__version__ and d["jax"] == jax.__version__
    assert d["ffi"]["cpu"]["built"] is True
    assert {"mok_experts_fwd_cpu", "mok_experts_bwd_cpu"} <= set(d["ffi"]["cpu"]["registered"])
    assert d["ffi"]["cuda"]["built"] == _ffi.cuda_built()
    assert d["default_backend"] == jax.default_backend()
    if jax.default_backend() == "cpu":
        assert d["auto_implementation"] == {"float32": "cpu", "bfloat16": "cpu"}
        assert d["gpus"] == [] and d["cuda_usable"] is False
        assert d["cuda_unavailable_reason"]
    text = info.format_info(d)
    assert f"mok_jax {mok_jax.__version__}" in text and "FFI cpu : built" in text


def test_unavailable_reasons():
    r = info.cuda_unavailable_reason
    assert "no nvcc" in r(False, None, [])
    assert r(False, "libcudart.so.13: cannot open", []) == "libcudart.so.13: cannot open"
    assert "sees no GPU" in r(True, None, [])
    assert "compute capability 8.0" in r(True, None, [{"compute_capability": "8.0"}])
    assert r(True, None, [{"compute_capability": "9.0"}]) is None


def test_module_runs_as_a_script():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "mok_jax.info", "--json"], capture_output=True,
                         text=True, env=env, timeout=120, check=True).stdout
    d = json.loads(out)
    assert d["mok_jax"] == mok_jax.__version__ and "cuda_unavailable_reason" in d
    text = subprocess.run([sys.executable, "-m", "mok_jax.info"], capture_output=True, text=True,
                          env=env, timeout=120, check=True).stdout
    assert "CUDA path:" in text and "jax " in text


def test_import_mok_jax_does_not_import_flax():
    code = ("import sys, mok_jax; assert 'flax' not in sys.modules, 'flax imported eagerly'; "
            "m = mok_jax.nnx; assert 'flax' in sys.modules and m.MoE.__name__ == 'MoE'; "
            "assert mok_jax.convert.experts_from_hf and mok_jax.info.collect")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True)


def test_cuda_build_options(monkeypatch):
    """The CUDA module's compile-time variants, as the benchmark records them:
    {} without the module, else what its build_options() reports."""
    from mok_jax import _ffi
    monkeypatch.setattr(_ffi, "cuda_built", lambda: False)
    assert info.cuda_build_options() == {}

    class FakeCuda:
        @staticmethod
        def build_options():
            return {"gemm_tma_store": True}

        @staticmethod
        def registrations():
            return {}

    monkeypatch.setattr(_ffi, "cuda_built", lambda: True)
    monkeypatch.setattr(_ffi, "_mok_cuda", FakeCuda)
    assert info.cuda_build_options() == {"gemm_tma_store": True}
    text = info.format_info({**info.collect(), "gpus": []})
    assert "FFI cuda build options: gemm_tma_store=True" in text
