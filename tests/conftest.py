import os
import sys

# 8 CPU devices for the shard_map tests; must be set before JAX initialises.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

# Whether the user chose JAX's platforms themselves (then this conftest leaves
# them alone); read by tests/test_conftest_platforms.py.
USER_SET_JAX_PLATFORMS = "JAX_PLATFORMS" in os.environ


def selects_gpu_tests(markexpr):
    """Whether a `-m` expression keeps the tests marked `gpu` (and no other mark)."""
    if not markexpr.strip():
        return True
    try:  # pytest's own evaluator: private, so guarded by the fallback below
        from _pytest.mark.expression import Expression
        return bool(Expression.compile(markexpr).evaluate(lambda name, **kwargs: name == "gpu"))
    except Exception:
        return "gpu" in markexpr.replace("not gpu", "")


def pytest_configure(config):
    # The default run (`-m 'not gpu'`) is the CPU suite: its meshes take
    # jax.devices()[:8] and its references call the CPU FFI targets, so on a
    # GPU host (where JAX's default backend is the GPU) it must still run on the
    # CPU devices. The GPU suite (`-m gpu`) keeps JAX's default platforms.
    if not USER_SET_JAX_PLATFORMS and not selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ["JAX_PLATFORMS"] = "cpu"  # read when jax is imported
        if "jax" in sys.modules:  # a plugin imported it first; its backends start lazily
            sys.modules["jax"].config.update("jax_platforms", "cpu")
