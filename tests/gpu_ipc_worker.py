"""One process of the two-process CUDA peer test (tests/test_gpu_peer.py).

Usage: python gpu_ipc_worker.py PROCESS_ID PORT SEED

Two processes on localhost share one GPU (local_device_ids=[0] each, so the
job has 2 devices) over `jax.distributed`: the expert group spans both, so
the peer calls map each other's control blocks and staging buffers through
CUDA IPC (ffi/peer_ipc.cu, mok_jax/_peer_ipc.py) and their kernels
time-slice on the GPU. Both build the same global inputs from SEED, run
dispatch="auto" (which must pick "peer") forward and backward (jax.vjp with a sharded cotangent: no
reduction, so no NCCL, which refuses two ranks on one GPU) three times, and
compare their own shards with the single-process EP = 1 CUDA kernel:
y and d_x bitwise, the weight gradients of their experts within relative
L2 1e-2 (bitwise when one round holds every row). Exit status 0 and a final
"IPC_WORKER_OK" line mean every check passed.
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    pid, port, seed = (int(a) for a in sys.argv[1:4])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, local_device_ids=[0], initialization_timeout=60)
    import mok_jax
    from mok_jax import parallel
    assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    # Both processes run on this host with peer-capable GPUs: dispatch="auto"
    # must pick the peer path, which the calls below then take through "auto".
    picked = parallel._resolve_dispatch("auto", "cuda", mesh, (256, 256, 256, 8, 2, 0, 2))
    assert picked == "peer", picked

    rng = np.random.default_rng(seed)
    for T, H, F, E, K, kind in [(512, 256, 256, 8, 2, "uniform"), (384, 512, 128, 16, 4, "one_rank")]:
        bf = jnp.bfloat16
        x = rng.standard_normal((T, H)).astype(np.float32)
        wg = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
        wu = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(np.float32)
        wd = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(np.float32)
        ids = rng.integers(0, E, (T, K)).astype(np.int32)
        if kind == "one_rank":  # every pair to the experts of process 1's rank
            ids = (E - 1 - np.arange(T * K) % (E // 2)).reshape(T, K).astype(np.int32)
        w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
        ct = rng.standard_normal((T, H)).astype(np.float32)
        host = dict(x=x.astype(bf), wg=wg.astype(bf), wu=wu.astype(bf), wd=wd.astype(bf),
                    ids=ids, w=w, ct=ct.astype(bf))

        def put(a, spec):
            sh = NamedSharding(mesh, spec)
            return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])

        rows = P("expert")
        g = dict(x=put(host["x"], rows), ids=put(host["ids"], rows), w=put(host["w"], rows),
                 ct=put(host["ct"], rows), wg=put(host["wg"], rows), wu=put(host["wu"], rows),
                 wd=put(host["wd"], rows))

        def f_peer(x, w, wg, wu, wd, ids):
            return parallel.experts_parallel(x, ids, w, wg, wu, wd, mesh=mesh, expert_axis="expert",
                                             implementation="cuda", dispatch="auto")

        @jax.jit
        def step(x, w, wg, wu, wd, ids, ct):
            y, vjp = jax.vjp(lambda *a: f_peer(*a, ids), x, w, wg, wu, wd)
            return y, vjp(ct)

        local = jax.local_devices()[0]

        @jax.jit
        def step_ep1(x, w, wg, wu, wd, ids, ct):
            f = lambda *a: mok_jax.experts(a[0], ids, *a[1:], implementation="cuda")
            y, vjp = jax.vjp(f, x, w, wg, wu, wd)
            return y, vjp(ct)

        ref = step_ep1(*(jax.device_put(host[k], local) for k in ("x", "w", "wg", "wu", "wd", "ids", "ct")))
        ref = jax.tree.map(np.asarray, ref)
        for call in range(3):  # the generation counters and staging carry over between calls
            y, (dx, dw, dwg, dwu, dwd) = step(*(g[k] for k in ("x", "w", "wg", "wu", "wd", "ids", "ct")))
            for name, got, want in (("y", y, ref[0]), ("dx", dx, ref[1][0]), ("d_topk_weights", dw, ref[1][1]),
                                    ("dw_gate", dwg, ref[1][2]), ("dw_up", dwu, ref[1][3]),
                                    ("dw_down", dwd, ref[1][4])):
                for s in got.addressable_shards:
                    a, b = np.asarray(s.data, np.float32), want[s.index].astype(np.float32)
                    if name in ("y", "dx", "d_topk_weights"):
                        assert np.array_equal(a, b), f"{kind} call {call} {name}: max |diff| {np.abs(a - b).max()}"
                    else:
                        err = rel_l2(a, b)
                        assert err <= 1e-2, f"{kind} call {call} {name}: relative L2 {err}"
        print(f"process {pid}: {kind} (T={T}, H={H}, F={F}, E={E}, K={K}) peer over IPC == EP=1 OK", flush=True)
    print("IPC_WORKER_OK", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
