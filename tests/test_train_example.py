"""examples/train_moe_lm.py: a short CPU run's loss drops, and a run resumed from
an orbax checkpoint continues exactly like an uninterrupted one."""

import io

import numpy as np
import pytest

from helpers import curve_gap, load_train_example

pytest.importorskip("flax.nnx")
pytest.importorskip("optax")


def test_loss_drops_and_resume_is_exact(tmp_path):
    ex = load_train_example()
    common = ["--config", "tiny", "--log-every", "10", "--eval-every", "20",
              "--implementation", "cpu", "--router-bias"]
    out = io.StringIO()
    full = ex.main(common + ["--steps", "40"], out=out)
    losses = [full["losses"][s] for s in range(40)]
    assert np.log(256) - 0.5 < losses[0] < np.log(256) + 0.5, "starts near uniform over bytes"
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.5, losses
    assert full["val_losses"][40] < losses[0] - 1.5
    assert "40/40" in out.getvalue() and "tok/s" in out.getvalue() and "load L0" in out.getvalue()
    assert len(full["final_load"]) == 2 and sum(full["final_load"][0]) == 16 * 64 * 2

    if pytest.importorskip("orbax.checkpoint") is None:
        return
    ckpt = str(tmp_path / "ckpt")
    first = ex.main(common + ["--steps", "40", "--stop-at", "20", "--ckpt-dir", ckpt],
                    out=io.StringIO())
    assert first["start_step"] == 0 and list(first["losses"]) == list(range(20))
    np.testing.assert_allclose([first["losses"][s] for s in range(20)], losses[:20], rtol=1e-5)
    out = io.StringIO()
    resumed = ex.main(common + ["--steps", "40", "--ckpt-dir", ckpt, "--resume"], out=out)
    assert resumed["start_step"] == 20 and "resumed" in out.getvalue()
    got = [resumed["losses"][s] for s in range(20, 40)]
    np.testing.assert_allclose(got, losses[20:], rtol=1e-5, atol=1e-6)


def test_kernel_and_reference_train_the_same_curve():
    """The same training run through the CPU FFI kernels and through the
    pure-JAX reference (float32): the loss curves agree to 1e-3 (window means
    of 10 steps) while the loss falls by more than 1."""
    ex = load_train_example()
    common = ["--config", "tiny", "--steps", "50", "--log-every", "50", "--eval-every", "1000"]
    runs = {impl: ex.main(common + ["--implementation", impl], out=io.StringIO())
            for impl in ("cpu", "xla")}
    gap = curve_gap(runs["cpu"], runs["xla"], 50, 10)
    assert gap < 1e-3, gap
    l = runs["cpu"]["losses"]
    assert np.mean([l[s] for s in range(40, 50)]) < np.mean([l[s] for s in range(10)]) - 1.0
