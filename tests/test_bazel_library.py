"""The Bazel-built CPU library (BUILD, //:libmok_jax_cpu.so) exports FFI
handlers that compute what the CMake-built module computes. Skipped unless
`bazel build //:libmok_jax_cpu.so` has run (.ci/run does when bazel exists)."""

import ctypes
import os

import jax
import numpy as np
import pytest

from mok_jax import _ffi
from helpers import fresh_key, make_problem

LIB = os.path.join(os.path.dirname(__file__), "..", "bazel-bin", "libmok_jax_cpu.so")


@pytest.mark.skipif(not os.path.exists(LIB), reason="bazel-bin/libmok_jax_cpu.so not built")
def test_bazel_library_matches_the_cmake_module():
    lib = ctypes.cdll.LoadLibrary(LIB)
    jax.ffi.register_ffi_target("bazel_mok_experts_fwd_cpu",
                                jax.ffi.pycapsule(lib.MokExpertsFwdCpu), platform="cpu")
    x, _, wg, wu, wd, shared = make_problem(37, 16, 24, 4, shared_ffn=8)
    ids = jax.random.randint(fresh_key(), (37, 2), 0, 4)
    inputs = [x, ids, jax.random.uniform(fresh_key(), (37, 2)), np.ones(37, np.uint8),
              wg, wu, wd, *shared]
    types = _ffi.forward_result_types(x, ids, wg, shared[0])
    got = jax.ffi.ffi_call("bazel_mok_experts_fwd_cpu", types)(*inputs)
    want = _ffi.forward_call("cpu", inputs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
