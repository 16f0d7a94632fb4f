"""dispatch="auto" (mok_jax/parallel.py: _auto_picks_peer): "peer" within one
host's GPUs, "collective" otherwise. Decided at trace time from the mesh's
devices and the CUDA module's answers, so it is tested here on CPU against
fake GPU devices, a fake CUDA module and a fake key-value store; the real
choice runs on GPUs in tests/test_gpu_peer.py."""

import types

import jax
import numpy as np
import pytest

from mok_jax import _ffi, _peer_ipc, parallel

DIMS = (256, 64, 64, 8, 2, 0, 2)  # (T_local, H, F, E, K, Fs, ep)


class FakeCuda:
    """The two _mok_cuda answers the choice reads."""

    def __init__(self, no_p2p=(), rejects=False):
        self.no_p2p, self.rejects, self.asked = set(no_p2p), rejects, []

    def peer_forward_workspace_bytes(self, T, H, F, E, K, Fs, ranks, round_rows, staged):
        return 0 if self.rejects else 4096

    def peer_access_problem(self, ordinals):
        self.asked.append(list(ordinals))
        bad = self.no_p2p & set(ordinals)
        return f"GPU {min(bad)} cannot access its peers" if bad else ""


class FakeStore:
    def __init__(self, hosts=None):
        self.kv = {f"mok_jax/host/{p}": h for p, h in (hosts or {}).items()}

    def key_value_set(self, key, value):
        assert key not in self.kv, f"{key} set twice"
        self.kv[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.kv:
            raise TimeoutError(key)
        return self.kv[key]


def _mesh(n, platform="gpu", per_process=None):
    per_process = per_process or n
    devs = [types.SimpleNamespace(id=i, platform=platform, process_index=i // per_process,
                                  local_hardware_id=i % per_process) for i in range(n)]
    return types.SimpleNamespace(devices=np.array(devs, dtype=object))


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(_ffi, "_mok_cuda", fake)
    monkeypatch.setattr(_peer_ipc, "_HOSTS", {})
    return fake


def _pick(impl, mesh, dims=DIMS, dispatch="auto"):
    return parallel._resolve_dispatch(dispatch, impl, mesh, dims)


def test_one_process_gpus_pick_peer(cuda):
    assert _pick("cuda", _mesh(4), DIMS[:6] + (4,)) == "peer"
    assert cuda.asked == [[0, 1, 2, 3]]  # every mesh GPU's peer access was checked


@pytest.mark.parametrize("case", ["ep1", "xla", "cpu", "no_p2p", "rejected"])
def test_auto_falls_back_to_collective(cuda, case):
    mesh, impl, dims = _mesh(2), "cuda", DIMS
    if case == "ep1":
        mesh, dims = _mesh(1), DIMS[:6] + (1,)
    elif case == "xla":
        impl = "xla"
    elif case == "cpu":
        mesh, impl = _mesh(2, platform="cpu"), "cpu"
    elif case == "no_p2p":
        cuda.no_p2p = {1}
    elif case == "rejected":
        cuda.rejects = True
    assert _pick(impl, mesh, dims) == "collective"
    # An explicit choice is never overridden by the checks "auto" makes.
    assert _pick(impl, mesh, dims, "collective") == "collective"


def test_processes_of_one_host_pick_peer(cuda, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    store = FakeStore({1: _peer_ipc.host_identity()})
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", store)
    mesh = _mesh(4, per_process=2)
    assert _pick("cuda", mesh, DIMS[:6] + (4,)) == "peer"
    assert store.kv["mok_jax/host/0"] == _peer_ipc.host_identity()  # published for the others
    assert cuda.asked == [[0, 1]]  # only this process's GPUs, by CUDA ordinal
    # Published once: a second trace neither sets nor waits again.
    assert _pick("cuda", mesh, DIMS[:6] + (4,)) == "peer"


def test_processes_of_two_hosts_pick_collective(cuda, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client",
                        FakeStore({1: "other-host|" + _peer_ipc.host_identity().split("|")[1]}))
    assert _pick("cuda", _mesh(4, per_process=2), DIMS[:6] + (4,)) == "collective"


def test_cpu_mesh_resolves_auto_to_collective_end_to_end():
    """On this job's real CPU mesh (no fakes) "auto" runs the collective path."""
    devs = np.array(jax.devices()[:2])
    if devs.size < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(devs, ("expert",))
    assert parallel._resolve_dispatch("auto", "cpu", mesh, DIMS) == "collective"
