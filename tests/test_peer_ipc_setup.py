"""The multi-process CUDA peer set-up (mok_jax/_peer_ipc.py) on CPU: its
handle exchange against a fake runtime and key-value store, as two processes
of a 4-device job would run it (the real one runs on a GPU in
tests/test_gpu_peer.py::test_jax_peer_two_processes_over_cuda_ipc)."""

import types

import jax
import pytest

import mok_jax
from mok_jax import _peer_ipc


class FakeRuntime:
    """_mok_cuda's three IPC functions: staging bytes from T, blobs naming
    (process, device, size)."""

    def __init__(self, process):
        self.process, self.exports, self.imports = process, [], []

    def peer_staging_bytes(self, T, H, F, E, K, Fs):
        return 0 if T == 0 else 1000 * T

    def peer_ipc_export(self, ordinal, global_id, size):
        self.exports.append((ordinal, global_id, size))
        return f"{self.process}:{global_id}:{size}".encode()

    def peer_ipc_import(self, blob):
        self.imports.append(blob.decode())


class FakeStore:
    """The jax.distributed key-value store shared by the fake processes."""

    def __init__(self):
        self.kv = {}

    def key_value_set_bytes(self, key, value):
        assert key not in self.kv, f"key {key} set twice"
        self.kv[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.kv:
            raise TimeoutError(f"no {key} after {timeout_ms} ms")
        return self.kv[key]


def _as_process(monkeypatch, process, runtime, store):
    """This test's process pretends to be `process` of 2, with devices 0,1 in
    process 0 and 2,3 in process 1 (CUDA ordinals 0 and 1 in each)."""
    devs = [types.SimpleNamespace(id=i, process_index=i // 2, local_hardware_id=i % 2) for i in range(4)]
    monkeypatch.setattr(jax, "devices", lambda *a: devs)
    monkeypatch.setattr(jax, "process_index", lambda: process)
    monkeypatch.setattr(mok_jax, "_mok_cuda", runtime, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "mok_jax._mok_cuda", runtime)
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", store)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(_peer_ipc, "_STAGED", {})


def _run(monkeypatch, runtime, store, T):
    """ensure() as process 0 of the 4-device group, for T tokens."""
    _as_process(monkeypatch, 0, runtime, store)
    _peer_ipc.ensure((0, 1, 2, 3), (T, 64, 64, 8, 2, 0), 1000)


def test_ensure_round_trip(monkeypatch):
    store, rt = FakeStore(), FakeRuntime(0)
    # Pre-publish process 1's blobs of epoch 1 so process 0's blocking gets succeed.
    for d in (2, 3):
        store.key_value_set_bytes(f"mok_jax/peer_ipc/0-1-2-3/1/{d}", f"1:{d}:10000".encode())
    _run(monkeypatch, rt, store, 10)
    assert rt.exports == [(0, 0, 10000), (1, 1, 10000)]  # ordinals of its own devices, exact size
    assert rt.imports == ["1:2:10000", "1:3:10000"]        # the other process's devices only
    # The same or a smaller shape: nothing exchanged again.
    _run(monkeypatch, rt, store, 10)
    _run(monkeypatch, rt, store, 5)
    assert len(rt.exports) == 2 and len(store.kv) == 4
    # A bigger one: a new epoch, staging at least doubled.
    for d in (2, 3):
        store.key_value_set_bytes(f"mok_jax/peer_ipc/0-1-2-3/2/{d}", f"1:{d}:20000".encode())
    _run(monkeypatch, rt, store, 11)
    assert rt.exports[2:] == [(0, 0, 20000), (1, 1, 20000)]
    assert rt.imports[2:] == ["1:2:20000", "1:3:20000"]
    assert store.kv["mok_jax/peer_ipc/0-1-2-3/2/0"] == b"0:0:20000"


def test_one_process_staged_needs_no_store(monkeypatch):
    """MOK_JAX_PEER_STAGING=1 in one process: every device local, exported,
    nothing swapped (no jax.distributed client)."""
    rt = FakeRuntime(0)
    _as_process(monkeypatch, 0, rt, None)
    _peer_ipc.ensure((0, 1), (10, 64, 64, 8, 2, 0), 1000)
    assert rt.exports == [(0, 0, 10000), (1, 1, 10000)] and rt.imports == []
    monkeypatch.setattr(_peer_ipc, "_ACTIVE", None)
    monkeypatch.setenv("MOK_JAX_PEER_STAGING", "1")
    assert _peer_ipc.active()
    monkeypatch.setattr(_peer_ipc, "_ACTIVE", None)
    monkeypatch.setenv("MOK_JAX_PEER_STAGING", "0")
    assert not _peer_ipc.active()  # one process, not forced


def test_missing_peer_and_missing_distributed_are_clear_errors(monkeypatch):
    store, rt = FakeStore(), FakeRuntime(0)
    _as_process(monkeypatch, 0, rt, store)
    with pytest.raises(TimeoutError, match="mok_jax/peer_ipc/0-1-2-3/1/2"):
        _peer_ipc.ensure((0, 1, 2, 3), (10, 64, 64, 8, 2, 0), 1000)
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", None)
    monkeypatch.setattr(_peer_ipc, "_STAGED", {})
    with pytest.raises(RuntimeError, match="jax.distributed.initialize"):
        _peer_ipc.ensure((0, 1, 2, 3), (10, 64, 64, 8, 2, 0), 1000)
    with pytest.raises(ValueError, match="reject this problem"):
        _peer_ipc.ensure((0, 1, 2, 3), (0, 64, 64, 8, 2, 0), 1000)
    monkeypatch.setattr(distributed.global_state, "client", store)
    with pytest.raises(ValueError, match=r"device ids \[7\]"):
        _peer_ipc.ensure((0, 7), (10, 64, 64, 8, 2, 0), 1000)
