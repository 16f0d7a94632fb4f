"""The CPU suite runs on JAX's CPU devices even on a GPU host (conftest.py sets
JAX_PLATFORMS=cpu unless the selection keeps the `gpu` tests or the user set
it), and the `-m` expressions are read the way pytest reads them."""
import os

import jax
import pytest

import conftest


@pytest.mark.parametrize("markexpr, selects", [
    ("not gpu", False), ("not gpu and not slow", False), ("(not gpu)", False),
    ("gpu", True), ("gpu or not gpu", True), ("", True), ("gpu and not slow", True),
])
def test_markexpr_selects_gpu_tests(markexpr, selects):
    assert conftest.selects_gpu_tests(markexpr) is selects


def test_cpu_suite_runs_on_cpu_devices(pytestconfig):
    if conftest.USER_SET_JAX_PLATFORMS:
        pytest.skip("JAX_PLATFORMS set by the user: conftest leaves it alone")
    if conftest.selects_gpu_tests(pytestconfig.getoption("markexpr") or ""):
        pytest.skip("the selection keeps the gpu tests: JAX keeps its default platforms")
    assert os.environ.get("JAX_PLATFORMS") == "cpu"
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("markexpr, selects", [("not gpu", False), ("gpu", True), ("gpu or not gpu", True)])
def test_markexpr_fallback_without_pytests_evaluator(monkeypatch, markexpr, selects):
    """The private `_pytest.mark.expression` may move: the fallback still reads the usual forms."""
    import sys
    monkeypatch.setitem(sys.modules, "_pytest.mark.expression", None)  # import now raises
    assert conftest.selects_gpu_tests(markexpr) is selects
