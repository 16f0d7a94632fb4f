#!/usr/bin/env bash
# One device session: build, GPU tests, demo, forward benchmark, SASS check.
# Usage (on the GPU host, from the repo root): bash benchmarks/gpu_session.sh [OUTDIR]
set -uo pipefail
out="${1:-${OUT:-/tmp/mok_out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
summary=()
step() {  # step NAME CMD...: runs CMD, logs to $out/NAME.log, records pass/fail
  local name="$1"; shift
  local t0=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$out/$name.log")")")
  return $rc
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
step build python3 -m pip install --no-build-isolation --no-deps -e . || { cat "$out/build.log" | tail -40; exit 1; }
so=$(python3 -c "import mok_jax._mok_cuda as m; print(m.__file__)")
echo "HGMMA in _mok_cuda: $(cuobjdump --dump-sass "$so" | grep -c HGMMA)" > "$out/sass.txt"
step gpu_tests python3 -m pytest -m gpu -q -x tests/test_gpu.py ${GPU_TESTS:+-k "$GPU_TESTS"}
step demo python3 -m mok_jax.demo
step bench python3 benchmarks/bench_forward.py --iters "${BENCH_ITERS:-20}" --json "$out/forward.json"
cp benchmarks/RESULTS.md "$out/RESULTS.md"
cat "$out/gpu.txt" "$out/sass.txt"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3
tail -4 "$out/demo.log"
tail -8 "$out/bench.log"
printf '%s\n' "${summary[@]}"
