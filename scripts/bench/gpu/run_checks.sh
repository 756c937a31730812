#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried
# (scripts/bench/gpu/build_bundle.sh). Applies the 0.5.14 series to the bundle's site-packages
# with this project's own toolchain, then runs the GPU tests. Results land in $OUT. SITE: where
# the bundle goes (default /tmp/site, which run_bench.sh uses too).
set -uo pipefail
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site}  # where the bundle is unpacked and patched
rm -rf "$SITE" && mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16 GIT_PYTHON_REFRESH=quiet
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C "$SITE" || exit 2
# SGLang's JIT modules built beforehand (build_jit_cache.sh), when carried.
if [ -f .devcarry/jit-cache.tar.xz ]; then
    mkdir -p "${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}"
    xz -dc .devcarry/jit-cache.tar.xz | tar xf - -C "${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}" || exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH=$SITE python3 -m scripts apply --version 0.5.14 --dir "$SITE" || exit 3
PYTHONPATH=$SITE python3 -m scripts verify --version 0.5.14 --dir "$SITE" | tail -2
export SGLANG_CHECKOUT=$SITE PYTHONPATH=$SITE:$PWD GPU_RESULTS=$OUT/gpu-results.json
python3 -m pytest -q -rA --basetemp=/tmp/pt "${@:-tests/gpu}" 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
# Every server's log, in one file (few files come back from the GPU machine).
(cd /tmp/pt && tar czf "$OUT/server-logs.tar.gz" */*.log 2>/dev/null)
exit "$status"
