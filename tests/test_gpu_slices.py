"""The three GPU-suite slices of tests/gpu_slices.py select every GPU test
exactly once (checked by collecting, which needs no GPU)."""
import subprocess
import sys

import gpu_slices


def _collect(args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 5), r.stdout[-2000:] + r.stderr[-2000:]  # 5: none selected
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_gpu_slices_partition_the_gpu_suite():
    # every GPU test of the suite, in any file (a new GPU test file must join a slice)
    everything = _collect(["-m", "gpu", "-p", "no:cacheprovider", "tests"])
    assert len(everything) > 50  # the suite was collected, not an empty selection
    slices = {n: _collect(gpu_slices.pytest_args(n)) for n in gpu_slices.SLICES}
    for n, tests in slices.items():
        assert tests, f"slice {n} selects nothing"
    picked = [t for tests in slices.values() for t in tests]
    assert sorted(picked) == sorted(everything)  # each test once, none left out
