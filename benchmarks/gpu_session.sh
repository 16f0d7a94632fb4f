#!/usr/bin/env bash
# One device call: Python build, variant timings (environment settings compared
# in separate processes), the GPU tests and the full benchmark; logs under $OUT.
# Usage (GPU host, repo root): bash benchmarks/gpu_session.sh [steps...]
#   steps default: variants pytest bench
#   VARIANTS      ';'-separated environment settings of the variants step
#                 (default: GEMM rasterisation bands 1 and 8)
#   VARIANT_ARGS  benchmarks.run arguments of each variant
#   PYTEST_K      pytest -k filter of the GPU suite (default: all of it; it
#                 takes ~15 min, more than one device call)
#   PYTEST_TO     seconds the pytest step may run (default 240)
#   BENCH_ARGS    benchmarks.run arguments of the bench step
set -uo pipefail
out="${OUT:-/tmp/mok_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false MOK_JAX_COMMIT="${MOK_JAX_COMMIT:-}"
steps="${*:-variants pytest bench}"
NEED_PY=1 source "$(dirname "$0")/../tests/cuda/session_common.sh"
wait_pip || exit 1
so=$(python3 -c "import mok_jax._mok_cuda as m; print(m.__file__)")
echo "HGMMA in _mok_cuda: $(cuobjdump --dump-sass "$so" | grep -c HGMMA)" > "$out/sass.txt"
if has variants; then
  IFS=';' read -ra variants <<< "${VARIANTS:-MOK_CUDA_GEMM_GROUP_M=1;MOK_CUDA_GEMM_GROUP_M=8}"
  for v in "${variants[@]}"; do
    n="var_$(echo "$v" | tr -c 'A-Za-z0-9' '_')"
    step "$n" 150 env $v python3 -m benchmarks.run --sweep '' --no-memory --no-plots --out "$out" --tag "$n" \
      ${VARIANT_ARGS:---shapes 4,1 --impls cuda,cuda-megakernel --passes fwd,fwd+bwd --iters 10}
  done
fi
has pytest && pytest_step "${PYTEST_TO:-240}" -x --durations=8 -k "${PYTEST_K:-}"
has bench && step bench 300 python3 -m benchmarks.run --out "$out" --tag gpu --partial "$out/gpu_partial.json" \
  ${BENCH_ARGS:---shapes 1,2,3,4 --impls cuda,cuda-megakernel,xla,torch --passes fwd,fwd+bwd --sweep ''}
echo "================ summary"
cat "$out/gpu.txt" "$out/sass.txt" 2>/dev/null
for f in "$out"/var_*.log "$out/bench.log"; do
  [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -E "^\| [a-z0-9]" "$f" | grep -v "^| shape " | cut -c1-160; }
done
[ -f "$out/pytest.log" ] && grep -E "passed|failed|Error" "$out/pytest.log" | tail -8
printf '%s\n' "${summary[@]}"
