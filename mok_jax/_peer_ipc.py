"""The multi-process CUDA peer path's set-up (ffi/peer_ipc.cu).

A peer call whose expert group spans several processes cannot publish XLA's
buffer addresses (they are private to a process), so each rank stages its
inputs and return rows in a library-owned buffer exported as a CUDA IPC
handle. This module, at trace time (every process traces the same SPMD
program in the same order, before any call of it runs):

- sizes the staging buffer of this process's devices in the group for the
  traced shapes (grown, never shrunk; ``_mok_cuda.peer_staging_bytes``),
- exports their control blocks and staging (``_mok_cuda.peer_ipc_export``),
- swaps the handles with the other processes through the ``jax.distributed``
  key-value store (no device collective: it works before any NCCL
  communicator exists, and when two processes share a GPU, which NCCL
  refuses), and maps theirs (``_mok_cuda.peer_ipc_import``).

Meshes that share a device must span the same processes: a growth of a
device's staging is announced to the processes of the mesh being traced.

``MOK_JAX_PEER_STAGING=1`` puts a single-process job on this path too (every
device local: nothing to swap, no jax.distributed needed): the fallback for
an allocator whose buffers peers cannot reach, at one copy of the inputs per
call. Read when a process first traces a peer call; set it before.
"""

import os
import socket

import jax

# device list -> (staging bytes exchanged for it, number of exchanges: each
# one gets fresh key-value keys)
_STAGED = {}


def active():
    """Whether this process's CUDA peer calls take the staged path (device
    lists of global ids, ensure() before each call is traced)."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = jax.process_count() > 1 or os.environ.get("MOK_JAX_PEER_STAGING", "0") == "1"
    return _ACTIVE


_ACTIVE = None


def _client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("dispatch='peer' over devices of several processes needs "
                           "jax.distributed.initialize() first (its key-value store carries "
                           "the CUDA IPC handles)")
    return client


def ensure(devices, dims, timeout_ms):
    """Makes every device of ``devices`` (global ids) reachable from this
    process with a staging buffer big enough for ``dims`` = (T_local, H, F, E,
    K, Fs, ...) as _ffi._peer_cuda_dims gives them."""
    from . import _mok_cuda
    need = int(_mok_cuda.peer_staging_bytes(*dims[:6]))
    if need == 0:
        T, H, F, E = dims[:4]
        raise ValueError(f"dispatch='peer': the CUDA peer kernels reject this problem "
                         f"(T={T}, H={H}, F={F}, E={E})")
    group = tuple(sorted(set(int(d) for d in devices)))
    have, epoch = _STAGED.get(group, (0, 0))
    if have >= need:
        return
    size = max(need, 2 * have)  # the same on every process: the same shapes in the same order
    by_id = {d.id: d for d in jax.devices()}
    me = jax.process_index()
    missing = [i for i in group if i not in by_id]
    if missing:
        raise ValueError(f"dispatch='peer': device ids {missing} are not devices of this job")
    remote = [i for i in group if by_id[i].process_index != me]
    client = _client() if remote else None
    epoch += 1
    prefix = f"mok_jax/peer_ipc/{'-'.join(map(str, group))}/{epoch}"
    for i in group:
        d = by_id[i]
        if d.process_index == me:
            blob = _mok_cuda.peer_ipc_export(int(d.local_hardware_id), i, size)
            if client is not None:
                client.key_value_set_bytes(f"{prefix}/{i}", blob)
    for i in remote:
        _mok_cuda.peer_ipc_import(client.blocking_key_value_get_bytes(f"{prefix}/{i}", timeout_ms))
    _STAGED[group] = (size, epoch)


# process index -> its host identity, once published (same_host)
_HOSTS = {}


def host_identity():
    """This process's host: its hostname and the kernel's boot id (two
    machines that share a hostname differ in boot id; two containers of one
    machine usually differ in hostname, which errs on the safe side:
    "collective")."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def same_host(processes, timeout_ms):
    """Whether every process of ``processes`` (indices) runs on this host:
    dispatch="auto" picks "peer" only then. Each process publishes its host
    identity once in the jax.distributed key-value store and reads the
    others' (every process of a mesh traces the same call, so each waits
    only for peers that are tracing it too)."""
    me = jax.process_index()
    client = _client()
    if me not in _HOSTS:
        _HOSTS[me] = host_identity()
        client.key_value_set(f"mok_jax/host/{me}", _HOSTS[me])
    for p in processes:
        if p not in _HOSTS:
            _HOSTS[p] = client.blocking_key_value_get(f"mok_jax/host/{p}", timeout_ms)
    return all(_HOSTS[p] == _HOSTS[me] for p in processes)
