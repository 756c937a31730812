#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried:
# the benchmark suites named as arguments (scripts/bench_dump.py), upstream and patched
# trees side by side. Results land in $OUT/bench-gpu.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}
rm -rf /tmp/site /tmp/site-upstream && mkdir -p "$OUT" /tmp/site /tmp/site-upstream
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16 GIT_PYTHON_REFRESH=quiet
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C /tmp/site || exit 2
cp -a /tmp/site/. /tmp/site-upstream/
PYTHONPATH=/tmp/site python3 -m scripts apply --version 0.5.14 --dir /tmp/site || exit 3
export SGLANG_CHECKOUT=/tmp/site UPSTREAM_TREE=/tmp/site-upstream PYTHONPATH=/tmp/site:$PWD
suites=()
for suite in "$@"; do suites+=(--suite "$suite"); done
df -T /tmp | tail -1
python3 -m scripts.bench_dump "${suites[@]}" --preset gpu --work-dir /tmp/bench --out "$OUT/bench-gpu.json" 2>&1 | tail -c 20000
status=${PIPESTATUS[0]}
tail -n 30 /tmp/bench/*.log > "$OUT/server-logs-tail.txt" 2>/dev/null
exit "$status"
