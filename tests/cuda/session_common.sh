# Shared by gpu_session_fwd.sh, gpu_session_bwd.sh and benchmarks/gpu_session.sh (sourced after they set
# $out and $steps): step selection, logged and timed steps, the GPU's clocks,
# and the Python build started in the background when pytest is a step (or
# NEED_PY is set), wait_pip and pytest_step.
has() { [[ " $steps " == *" $1 "* ]]; }
summary=()
step() {  # step NAME TIMEOUT CMD...: logs to $out/NAME.log, records rc, time, last line
  local name="$1" to="$2"; shift 2
  local t0=$SECONDS
  timeout -s KILL "$to" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | cut -c1-150)")")
  return $rc
}
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; } > "$out/gpu.txt" 2>&1
if has pytest || [ -n "${NEED_PY:-}" ]; then
  (python3 -m pip install --no-build-isolation --no-deps -e . > "$out/pip.log" 2>&1; echo $? > /tmp/pip.rc) &
  pip_pid=$!
fi
# wait_pip: waits (once) for the background Python build; fails, with the
# build log's tail, when the build failed.
pip_done=""
wait_pip() {
  if [ -z "$pip_done" ]; then
    wait "$pip_pid"
    pip_done=1
    summary+=("pip rc=$(cat /tmp/pip.rc)")
  fi
  [ "$(cat /tmp/pip.rc)" = "0" ] || { tail -30 "$out/pip.log"; return 1; }
}
# pytest_step TIMEOUT [pytest args...]: the GPU tests of tests/test_gpu.py
# after the Python build.
pytest_step() {
  local to="$1"; shift
  wait_pip && step pytest "$to" python3 -m pytest -m gpu -q "$@" tests/test_gpu.py
}
