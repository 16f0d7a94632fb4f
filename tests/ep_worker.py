"""One process of the two-process expert-parallel test (tests/test_expert_parallel.py).

Usage: python ep_worker.py PROCESS_ID NUM_PROCESSES PORT SEED

Each process owns 2 CPU devices; the 2 processes form one 4-device mesh
(data=2 x expert=2, or expert=4) over `jax.distributed` with gloo CPU
collectives. Both build the same global inputs from SEED, run the
dispatch="collective" layer (forward and every gradient) and compare the
gathered global results with the single-process EP=1 kernel; dispatch="peer"
across the processes must raise NotImplementedError (CPU devices of two
processes share no memory; GPUs use CUDA IPC, tests/gpu_ipc_worker.py). Exit status 0
and a final "EP_WORKER_OK" line mean every check passed.
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", "") +
    " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the 0.12 default, explicit

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def main():
    pid, nproc, port, seed = (int(a) for a in sys.argv[1:5])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid, initialization_timeout=60)
    import mok_jax
    assert jax.process_count() == nproc and len(jax.devices()) == 2 * nproc, jax.devices()

    T, H, F, E, K, Fs = 64, 16, 24, 8, 2, 8
    rng = np.random.default_rng(seed)  # same seed: the same global inputs everywhere
    x = rng.standard_normal((T, H), np.float32)
    router = (rng.standard_normal((H, E)) / np.sqrt(H)).astype(np.float32)
    wg = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    wu = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
    sh = tuple((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
               for s in ((H, Fs), (H, Fs), (Fs, H)))
    ct = rng.standard_normal((T, H)).astype(np.float32)
    mask = rng.random(T) > 0.1

    def loss(x, router, wg, wu, wd, sh, **kw):
        y, _ = mok_jax.moe_layer(x, router, wg, wu, wd, top_k=K, shared_experts=sh,
                                 token_mask=jnp.asarray(mask), **kw)
        return jnp.sum(y * ct), y

    args = (x, router, wg, wu, wd, sh)
    local = jax.local_devices()[0]
    ref_args = jax.device_put(args, local)
    (_, y_ref), g_ref = jax.jit(jax.value_and_grad(
        lambda *a: loss(*a, implementation="cpu"), argnums=tuple(range(6)),
        has_aux=True))(*ref_args)

    devices = np.array(jax.devices())
    # data x expert with the expert axis across the two processes, then expert=4.
    for grid, names in ((devices.reshape(2, 2).T, ("data", "expert")),
                        (devices, ("expert",))):
        mesh = Mesh(grid, names)
        shape = grid.shape
        spans = {d.process_index for d in grid.reshape(-1, shape[-1])[0]}
        assert spans == set(range(nproc)), f"expert axis spans processes {spans}"
        rep = NamedSharding(mesh, P())
        glob = jax.tree.map(
            lambda a: jax.make_array_from_callback(a.shape, rep, lambda idx, a=a: a[idx]), args)
        f = jax.jit(jax.value_and_grad(
            lambda *a: loss(*a, mesh=mesh, expert_axis="expert", dispatch="collective"),
            argnums=tuple(range(6)), has_aux=True))
        (_, y), g = f(*glob)
        y = multihost_utils.process_allgather(y, tiled=True)
        g = multihost_utils.process_allgather(g, tiled=True)
        # y to fp32 rounding, not bitwise: the router's logits are XLA's dot over
        # each shard's rows, which (jax 0.12.1, CPU) rounds differently from the
        # dot over all T rows by up to 4.8e-7, and the routing weights with it.
        y, y_ref = np.asarray(y), np.asarray(y_ref)
        err = float(np.max(np.abs(y - y_ref)) / max(float(np.max(np.abs(y_ref))), 1e-30))
        assert err <= 1e-5, (names, f"y: relative max error {err:.3g}")
        for i, (a, b) in enumerate(zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))):
            a, b = np.asarray(a), np.asarray(b)
            err = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
            assert err <= 1e-5, (names, f"gradient {i}: relative max error {err:.3g}")
        print(f"process {pid}: mesh {dict(zip(names, shape))} OK", flush=True)
    # dispatch="peer" needs every device in one process: a clear error, raised
    # before any work (so no process waits for the other).
    try:
        loss(*glob, mesh=mesh, expert_axis="expert", dispatch="peer")
    except NotImplementedError as e:
        assert "dispatch='peer' over CPU devices needs every mesh device in this process" in str(e), e
    else:
        raise AssertionError("dispatch='peer' across processes did not raise")
    print(f"process {pid}: peer across processes refused OK", flush=True)
    jax.distributed.shutdown()
    print("EP_WORKER_OK", flush=True)


if __name__ == "__main__":
    main()
