"""The GPU suite (`pytest -m gpu`, ~17 min on one H100) in three slices of
~5-7 min, one device call apiece (a device call may run 10 minutes).

    python3 tests/gpu_slices.py N [pytest args...]      (GPU host, repo root; N = 1, 2, 3)

Run the slices in consecutive calls: the machine stays warm for a short while
after each, so the first call's Python build is reused (this runner installs
the package only when `mok_jax._mok_cuda` does not import). The split follows
the per-test durations of the twenty-fourth session (H100, --durations=0):
  1  tests/test_gpu_peer.py (> 230 s) and the small and edge-case forwards (~100 s)
  2  the megakernels' bitwise and edge tests, the training loss curve (97 s),
     CUDA graphs, the inference forward, the layer gradients (~300 s)
  3  everything else: the benchmark shapes forward and backward and the
     backward edge cases (~320 s)
tests/test_gpu_slices.py checks on CPU that the slices select every GPU
test exactly once, so a new test cannot fall out of the rotation.
"""
import os
import subprocess
import sys

GPU_FILES = ["tests/test_gpu_peer.py", "tests/test_gpu.py"]
_A = "small_vs_float64 or forward_edge_cases"
_B = ("megakernel or loss_curve or graphs or inference_forward or layer_gradients or auto_picks"
      " or is_the_ffi_target")
# slice -> (files, -k expression); the third is the rest of tests/test_gpu.py.
SLICES = {
    1: (GPU_FILES, f"test_gpu_peer or {_A}"),
    2: (["tests/test_gpu.py"], _B),
    3: (["tests/test_gpu.py"], f"not ({_A} or {_B})"),
}


def pytest_args(n):
    files, k = SLICES[n]
    return ["-m", "gpu", "-p", "no:cacheprovider", *files, "-k", k]


def main(argv):
    if not argv or not argv[0].isdigit() or int(argv[0]) not in SLICES:
        sys.exit(f"usage: python3 tests/gpu_slices.py N [pytest args...] with N in {sorted(SLICES)}")
    n, extra = int(argv[0]), argv[1:]
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    probe = subprocess.run([sys.executable, "-c", "import mok_jax._mok_cuda"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-e", "."],
                       check=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=0", *pytest_args(n), *extra]
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
