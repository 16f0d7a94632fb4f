"""benchmarks/run.py on CPU: a tiny run end to end (JSON, table, plots) and its
routing generator."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "benchmarks", "run.py")


def _load_run():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_run", RUN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_routing_generator_controls_the_load():
    run = _load_run()
    T, E, K = 4000, 8, 2
    stats = {}
    for kind in run.ROUTINGS:
        ids, w = run.routing(kind, T, E, K, seed=3)
        assert ids.shape == (T, K) and ids.dtype == np.int32
        assert np.all((ids >= 0) & (ids < E))
        assert np.all(ids[:, 0] != ids[:, 1]), "k distinct experts per token"
        np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)
        stats[kind] = run.load_stats(ids, E)
    assert stats["uniform"]["imbalance"] < 1.1
    assert stats["all-to-one"]["imbalance"] == pytest.approx(E / K)
    assert 1.5 < stats["zipf"]["imbalance"] < E / K
    counts = np.bincount(run.routing("zipf", T, E, K, seed=3)[0].ravel(), minlength=E)
    assert counts[0] > counts[E // 2] > counts[-1], "Zipf: load decreases with the expert id"
    assert run.parse_shapes("1,cpu-s,64x32x48x4x2")[2] == ("64x32x48x4x2", 64, 32, 48, 4, 2)
    with pytest.raises(SystemExit, match="--shapes"):
        run.parse_shapes("64x32x48x4x9")


def test_median_ms_pipelines_calls_and_blocks_on_the_last(monkeypatch):
    """--pipeline n: each sample dispatches n calls back to back, blocks once
    (on the last call's result) and is divided by n."""
    run = _load_run()
    common = sys.modules[run.median_ms.__module__]
    calls, blocked = [], []
    clock = iter(range(0, 1000, 6))  # each sample spans 6 s of the fake clock
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(common.jax, "block_until_ready", lambda out: blocked.append(out) or out)

    def fn():
        calls.append(len(calls))
        return len(calls) - 1

    ms = run.median_ms(fn, warmup=1, iters=2, pipeline=3)
    assert len(calls) == 1 + 2 * 3
    assert blocked == [0, 3, 6], "one block per warm-up call and per sample, on its last call"
    assert ms == pytest.approx(1e3 * 6 / 3)
    with pytest.raises(SystemExit):
        run.main(["--pipeline", "0"])


def test_tiny_cpu_run_writes_json_table_and_plots(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, RUN, "--shapes", "96x16x32x4x2", "--impls", "cpu,xla",
           "--passes", "fwd,bwd,fwd+bwd", "--sweep", "uniform,zipf,all-to-one",
           "--iters", "2", "--warmup", "1", "--xla-iters", "2", "--out", str(tmp_path),
           "--tag", "test", "--record", str(tmp_path / "RESULTS.md"), "--pipeline", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12/24" in proc.stdout, "progress lines"  # (1 shape + 3 sweeps) x 2 impls x 3 passes
    data = json.loads((tmp_path / "test_latest.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["backend"] == "cpu" and meta["dense_tflops"]["jax"] > 0 and meta["pipeline"] == 2
    assert len(rows) == 24
    for r in rows:
        assert "error" not in r, r
        mult = {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[r["pass"]]
        assert r["useful_flops"] == 6 * r["T"] * r["k"] * r["H"] * r["F"] * mult
        assert r["tflops"] == pytest.approx(r["useful_flops"] / r["ms"] / 1e9)
    sweep = {r["routing"]: r["imbalance"] for r in rows if r["routing"] != "router"}
    assert sweep["all-to-one"] == pytest.approx(2.0)  # E/k = 4/2
    checked = [r for r in rows if "rel_l2_vs_xla" in r]
    assert len(checked) == 1 and all(r["rel_l2_vs_xla"] < 1e-5 for r in checked)
    assert "| shape | routing |" in proc.stdout
    # --record: one RESULTS.md row per pass of the main table, ours (cpu) beside xla
    recorded = (tmp_path / "RESULTS.md").read_text().splitlines()
    assert [line.split(" | ")[3] for line in recorded] == ["fwd", "bwd", "fwd+bwd"]
    for line, pass_ in zip(recorded, ["fwd", "bwd", "fwd+bwd"]):
        ours = next(r for r in rows if r["routing"] == "router" and r["impl"] == "cpu" and r["pass"] == pass_)
        xla = next(r for r in rows if r["routing"] == "router" and r["impl"] == "xla" and r["pass"] == pass_)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == meta["commit"] and cells[4] == "96x16x32x4x2 (96,16,32,4,2)"
        assert float(cells[5]) == pytest.approx(ours["ms"], abs=0.006)
        assert float(cells[6]) == pytest.approx(ours["tflops"], abs=0.06)
        assert cells[7] == "—" and float(cells[8]) == pytest.approx(xla["tflops"], abs=0.06)
        assert cells[11].startswith("`python ") and "--record" in cells[11]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipping plots" in proc.stdout
    else:
        for name in ("test_tflops.png", "test_imbalance.png"):
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_expert_parallel_impls_on_cpu_devices(tmp_path):
    """--ep 4 over 4 CPU devices: the peer and collective layers run, their
    forward agrees with the pure-JAX reference, and the run records ep."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    cmd = [sys.executable, RUN, "--shapes", "96x16x32x4x2", "--impls",
           "xla,cpu-peer,cpu-collective", "--ep", "4", "--passes", "fwd,fwd+bwd", "--sweep", "",
           "--iters", "2", "--warmup", "1", "--xla-iters", "2", "--out", str(tmp_path),
           "--tag", "ep", "--no-plots"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "ep_latest.json").read_text())
    assert data["meta"]["ep"] == 4
    rows = {(r["impl"], r["pass"]): r for r in data["rows"]}
    assert len(rows) == 6
    for (impl, pass_), r in rows.items():
        assert "error" not in r, r
        assert r["ms"] > 0
        if impl != "xla" and pass_ == "fwd":
            assert r["rel_l2_vs_xla"] < 1e-5, r
