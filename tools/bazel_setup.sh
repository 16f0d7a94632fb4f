#!/usr/bin/env bash
# Links third_party/xla_ffi/include to the XLA FFI headers of the installed
# jaxlib (pass the Python that has jax as $1, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-python3}"
inc="$("$py" -c 'import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))')"
test -f "$inc/xla/ffi/api/ffi.h" || { echo "no XLA FFI headers under $inc" >&2; exit 1; }
mkdir -p third_party/xla_ffi
ln -sfn "$inc" third_party/xla_ffi/include
echo "third_party/xla_ffi/include -> $inc"
