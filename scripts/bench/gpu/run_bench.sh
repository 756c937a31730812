#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried:
# the benchmark suites named as arguments, upstream and patched trees side by side.
# `writer` runs scripts/bench/writer.py (the dump writer alone, on the disk and on
# /dev/shm); any other name is a scripts/bench/dump.py suite. BENCH_DEADLINE_S, when set,
# is bench_dump's --deadline-s; BENCH_TIMEOUT_S, when set, stops bench_dump after that
# many seconds, so its log and the servers' logs still reach $OUT before the call's own
# limit. Results land in $OUT/bench-*.json, bench_dump's output in $OUT/bench-gpu.log as
# it runs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
rm -rf /tmp/site /tmp/site-upstream /tmp/bench-writer /dev/shm/bench-writer && mkdir -p "$OUT" /tmp/site /tmp/site-upstream
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16 GIT_PYTHON_REFRESH=quiet
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C /tmp/site || exit 2
cp -a /tmp/site/. /tmp/site-upstream/
PYTHONPATH=/tmp/site python3 -m scripts apply --version 0.5.14 --dir /tmp/site || exit 3
export SGLANG_CHECKOUT=/tmp/site UPSTREAM_TREE=/tmp/site-upstream PYTHONPATH=/tmp/site:$PWD
df -T /tmp /dev/shm | tail -2
status=0
suites=()
for suite in "$@"; do
    if [ "$suite" = writer ]; then
        for pair in disk:/tmp/bench-writer tmpfs:/dev/shm/bench-writer; do
            name=${pair%%:*} target=${pair#*:}
            python3 -m scripts.bench.writer --dir "$target" --files 32 --repeats 2 \
                --out "$OUT/bench-writer-$name.json" > "$OUT/bench-writer-$name.txt" 2>&1 || status=1
            tail -n 3 "$OUT/bench-writer-$name.txt"
            rm -rf "$target"
        done
    else
        suites+=(--suite "$suite")
    fi
done
if [ ${#suites[@]} -gt 0 ]; then
    deadline=()
    [ -n "${BENCH_DEADLINE_S:-}" ] && deadline=(--deadline-s "$BENCH_DEADLINE_S")
    timeout "${BENCH_TIMEOUT_S:-0}" python3 -m scripts.bench.dump "${suites[@]}" "${deadline[@]}" \
        --preset gpu --work-dir /tmp/bench --out "$OUT/bench-gpu.json" > "$OUT/bench-gpu.log" 2>&1 || status=1
    tail -c 8000 "$OUT/bench-gpu.log"
    tail -n 30 /tmp/bench/*.log > "$OUT/server-logs-tail.txt" 2>/dev/null
fi
exit "$status"
