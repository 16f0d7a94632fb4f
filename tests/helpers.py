"""Shared test helpers: fresh random problems and error metrics."""

import jax
import jax.numpy as jnp
import numpy as np

_SEED = [1000]


def fresh_key():
    """A new key per call: every check sees fresh random inputs."""
    _SEED[0] += 1
    return jax.random.key(_SEED[0])


def make_problem(T, H, F, E, dtype=jnp.float32, shared_ffn=0, lead=None):
    ks = jax.random.split(fresh_key(), 8)
    shape = (T, H) if lead is None else (*lead, H)
    x = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    router = jax.random.normal(ks[1], (H, E), jnp.float32) / np.sqrt(H)
    wg = (jax.random.normal(ks[2], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wu = (jax.random.normal(ks[3], (E, H, F)) / np.sqrt(H)).astype(dtype)
    wd = (jax.random.normal(ks[4], (E, F, H)) / np.sqrt(F)).astype(dtype)
    shared = None
    if shared_ffn:
        shared = ((jax.random.normal(ks[5], (H, shared_ffn)) / np.sqrt(H)).astype(dtype),
                  (jax.random.normal(ks[6], (H, shared_ffn)) / np.sqrt(H)).astype(dtype),
                  (jax.random.normal(ks[7], (shared_ffn, H)) / np.sqrt(shared_ffn)).astype(dtype))
    return x, router, wg, wu, wd, shared


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cosine(a, b):
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def tolerances(dtype):
    """(relative L2 bound, cosine bound) per the project standard."""
    return (1e-2, 0.9999) if dtype == jnp.bfloat16 else (2e-5, 0.99999999)


def _judge(name, dtype, finite, r, c, want_norm):
    """The project's tolerances applied to (all finite, relative L2, cosine, ||want||)."""
    rel_tol, cos_tol = tolerances(dtype)
    assert finite, f"{name}: non-finite values"
    assert r <= rel_tol, f"{name}: relative L2 {r:.3g} > {rel_tol}"
    if want_norm > 0:
        assert c >= cos_tol, f"{name}: cosine {c:.8f} < {cos_tol}"


def assert_close(name, got, want, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    finite = bool(np.all(np.isfinite(got)))
    wn = float(np.linalg.norm(np.asarray(want, np.float64)))
    # the metrics only where they are defined (the old early-exit order)
    r = rel_l2(got, want) if finite else float("nan")
    c = cosine(got, want) if finite and wn > 0 else 1.0
    _judge(name, dtype, finite, r, c, wn)


@jax.jit
def _device_error_stats(got, want):
    """(all finite, relative L2, cosine, ||want||) in float32 on the arrays'
    device. The cosine comes from the distance of the normalised vectors,
    1 - |a/|a| - b/|b||^2 / 2, so a float32 sum's relative error moves it by
    that error times (1 - cos), not by the error itself."""
    g = got.astype(jnp.float32).ravel()
    w = want.astype(jnp.float32).ravel()
    gn = jnp.sqrt(jnp.sum(g * g))
    wn = jnp.sqrt(jnp.sum(w * w))
    rel = jnp.sqrt(jnp.sum(jnp.square(g - w))) / jnp.maximum(wn, 1e-30)
    d = g / jnp.maximum(gn, 1e-30) - w / jnp.maximum(wn, 1e-30)
    return jnp.all(jnp.isfinite(g)), rel, 1.0 - 0.5 * jnp.sum(d * d), wn


def assert_close_on_device(name, got, want, dtype):
    """assert_close judged on the device, for gradients of hundreds of millions
    of elements (Mixtral's dW: 470M each), where the float64 host copies made a
    GPU test take ~80 s."""
    finite, r, c, wn = (float(v) for v in _device_error_stats(jnp.asarray(got), jnp.asarray(want)))
    _judge(name, dtype, finite, r, c, wn)


def bitwise_equal(a, b):
    """Whether two arrays of one dtype hold the same bits (compared on their device)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[a.dtype.itemsize]
    cast = lambda v: jax.lax.bitcast_convert_type(v, bits)
    return bool(jnp.all(cast(a) == cast(b)))


def load_train_example():
    """examples/train_moe_lm.py as a module (its main(argv, out) runs a training)."""
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "train_moe_lm", os.path.join(root, "examples", "train_moe_lm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def curve_gap(a, b, steps, window):
    """Largest gap between two training runs' loss curves, as window means."""
    la = np.array([a["losses"][s] for s in range(steps)])
    lb = np.array([b["losses"][s] for s in range(steps)])
    means = lambda l: l[: steps // window * window].reshape(-1, window).mean(1)
    return float(np.max(np.abs(means(la) - means(lb))))


def run_worker_processes(worker, args_of, n, ok_marker, env, timeout):
    """Starts `n` localhost processes of the script `worker` (process i gets
    the arguments args_of(i, port), port a free coordinator port), waits for
    all, and asserts each exited 0 printing `ok_marker`. Returns the outputs."""
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, worker, *map(str, args_of(i, port))], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for i in range(n)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and ok_marker in out, f"process {i}:\n{out[-3000:]}"
    return outs
