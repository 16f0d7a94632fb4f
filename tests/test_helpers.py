"""The on-device judge of the GPU gradient tests agrees with the float64 one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close_on_device, bitwise_equal, cosine, fresh_key, rel_l2, _device_error_stats


@pytest.mark.parametrize("noise", [0.0, 1e-4, 3e-3, 2e-2, 0.5])
def test_device_stats_match_float64(noise):
    want = jax.random.normal(fresh_key(), (1 << 20,), jnp.float32)
    got = (want + noise * jax.random.normal(fresh_key(), want.shape)).astype(jnp.bfloat16)
    finite, r, c, wn = (float(v) for v in _device_error_stats(got, want))
    g64 = np.asarray(got.astype(jnp.float32), np.float64)
    assert finite == 1.0
    assert r == pytest.approx(rel_l2(g64, want), rel=1e-4, abs=1e-7)
    # 1 - cos is what the 0.9999 bound judges: accurate on its own scale, down to
    # 1e-7 absolute (0.1 % of the bound; float32 rounding of the normalised vectors)
    assert 1 - c == pytest.approx(1 - cosine(g64, want), rel=1e-3, abs=1e-7)
    assert wn == pytest.approx(np.linalg.norm(np.asarray(want, np.float64)), rel=1e-5)


def test_device_judge_fails_what_the_float64_judge_fails():
    want = jax.random.normal(fresh_key(), (4096,), jnp.float32)
    assert_close_on_device("ok", want.astype(jnp.bfloat16), want, jnp.bfloat16)
    with pytest.raises(AssertionError, match="relative L2"):
        assert_close_on_device("far", (want * 1.05).astype(jnp.bfloat16), want, jnp.bfloat16)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_on_device("nan", want.at[7].set(jnp.nan), want, jnp.bfloat16)
    # all-zero reference and result: the relative L2 is 0 and the cosine is not judged
    assert_close_on_device("zeros", jnp.zeros(8), jnp.zeros(8), jnp.bfloat16)


def test_bitwise_equal():
    a = jax.random.normal(fresh_key(), (3, 5), jnp.float32).astype(jnp.bfloat16)
    assert bitwise_equal(a, a + 0)
    assert not bitwise_equal(a, a.at[1, 2].add(1))
    assert not bitwise_equal(a, a.astype(jnp.float32))
    assert bitwise_equal(jnp.float32(-0.0), jnp.float32(-0.0))
    assert not bitwise_equal(jnp.float32(0.0), jnp.float32(-0.0))  # same value, other bits
