#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried:
# the benchmark suites named as arguments, upstream and patched trees side by side.
# `writer` runs scripts/bench/writer.py (the dump writer alone, on the disk and on
# /dev/shm), `writer-disk` the writer alone on the disk with 4 threads in bf16 and fp8,
# `writer-busy` the writer alone on /dev/shm with 4 threads beside a busy Python thread and not,
# `pinned` scripts/bench/pinned.py (pinned host allocations, cold and warm), `answer-steps`
# scripts/bench/answer_steps.py (the dump's time per decode step of dumped answers), `fp8-rows`
# scripts/bench/fp8_rows.py (fp8 quantization of a forward's rows, PyTorch against the
# kernel); any other name
# is a scripts/bench/dump.py suite, run with the preset BENCH_PRESET (default gpu; gpu-rank:
# a TP8 rank's compute, with the Mooncake sink's contenders) and, when set, --contenders
# "$BENCH_CONTENDERS". BENCH_DEADLINE_S, when set,
# is bench_dump's --deadline-s, BENCH_REPEATS its --repeats, BENCH_PROMPTS its --prompts; BENCH_TIMEOUT_S, when set, stops bench_dump after that
# many seconds, so its log and the servers' logs still reach $OUT before the call's own
# limit. Results land in $OUT/bench-*.json, bench_dump's output in $OUT/bench-gpu*.log as
# it runs; the profile suite's raw py-spy samples in $OUT/py-spy-raw-*.txt.gz, the trace suite's
# traces in $OUT/trace-*.trace.json.gz. BENCH_PARALLEL=1
# runs each suite in its own process, all at once.
set -uo pipefail
OUT=${OUT:-/tmp/out}
rm -rf /tmp/site /tmp/site-upstream /tmp/bench-writer /dev/shm/bench-writer && mkdir -p "$OUT" /tmp/site /tmp/site-upstream
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16 GIT_PYTHON_REFRESH=quiet
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C /tmp/site || exit 2
cp -a /tmp/site/. /tmp/site-upstream/
PYTHONPATH=/tmp/site python3 -m scripts apply --version 0.5.14 --dir /tmp/site || exit 3
. scripts/bench/gpu/store_env.sh /tmp/site  # the Mooncake sink's contenders and their local store
export SGLANG_CHECKOUT=/tmp/site UPSTREAM_TREE=/tmp/site-upstream PYTHONPATH=/tmp/site:$PWD
[ -x /tmp/site/bin/py-spy ] && export PY_SPY=/tmp/site/bin/py-spy  # the profile suite's profiler
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
    elif [ "$suite" = writer-disk ]; then
        # The writer alone on the disk with the server's default threads, bf16 and fp8: what
        # the gpu-rank preset's disk contenders are held against.
        for encoding in bf16 fp8; do
            flag=()
            [ "$encoding" = fp8 ] && flag=(--fp8)
            python3 -m scripts.bench.writer --dir /tmp/bench-writer --files 64 --repeats 3 --threads 4 "${flag[@]}" \
                --out "$OUT/bench-writer-disk-$encoding.json" > "$OUT/bench-writer-disk-$encoding.txt" 2>&1 || status=1
            tail -n 3 "$OUT/bench-writer-disk-$encoding.txt"
            rm -rf /tmp/bench-writer
        done
    elif [ "$suite" = writer-busy ]; then
        # The writer alone on /dev/shm with the server's default threads, with and without a
        # busy Python thread beside it: what sharing the interpreter lock with a scheduler
        # thread costs the writers.
        python3 -m scripts.bench.writer --dir /dev/shm/bench-writer --files 64 --repeats 3 --threads 4 --busy-thread \
            --out "$OUT/bench-writer-busy.json" > "$OUT/bench-writer-busy.txt" 2>&1 || status=1
        tail -n 3 "$OUT/bench-writer-busy.txt"
        rm -rf /dev/shm/bench-writer
    elif [ "$suite" = fp8-rows ]; then
        python3 -m scripts.bench.fp8_rows --out "$OUT/bench-fp8-rows.json" > "$OUT/bench-fp8-rows.txt" 2>&1 || status=1
        tail -n 3 "$OUT/bench-fp8-rows.txt"
    elif [ "$suite" = pinned ]; then
        python3 -m scripts.bench.pinned --out "$OUT/bench-pinned.json" > "$OUT/bench-pinned.txt" 2>&1 || status=1
        tail -n 12 "$OUT/bench-pinned.txt"
    elif [ "$suite" = answer-steps ]; then
        python3 -m scripts.bench.answer_steps --out "$OUT/bench-answer-steps.json" > "$OUT/bench-answer-steps.txt" 2>&1 || status=1
        tail -n 3 "$OUT/bench-answer-steps.txt"
    else
        suites+=(--suite "$suite")
    fi
done
# BENCH_WORK_ROOT: where bench_dump's work dirs go, and so the dumps of the suites that
# dump into them (hidden, write, scaling): /tmp (the disk) unless set, e.g. to /dev/shm.
WORK_ROOT=${BENCH_WORK_ROOT:-/tmp}
deadline=()
[ -n "${BENCH_DEADLINE_S:-}" ] && deadline=(--deadline-s "$BENCH_DEADLINE_S")
repeats=()  # BENCH_REPEATS: rounds instead of the preset's
[ -n "${BENCH_REPEATS:-}" ] && repeats=(--repeats "$BENCH_REPEATS")
prompts=()  # BENCH_PROMPTS: prompts a round, for longer rounds
[ -n "${BENCH_PROMPTS:-}" ] && prompts=(--prompts "$BENCH_PROMPTS")
contenders=()  # BENCH_CONTENDERS: the prefill suite's --contenders regex
[ -n "${BENCH_CONTENDERS:-}" ] && contenders=(--contenders "$BENCH_CONTENDERS")
bench_dump() {  # bench_dump NAME SUITE_ARGS...: one bench_dump process, its results and log named NAME
    local name=$1
    shift
    timeout "${BENCH_TIMEOUT_S:-0}" python3 -m scripts.bench.dump "$@" "${deadline[@]}" "${repeats[@]}" "${prompts[@]}" \
        --preset "${BENCH_PRESET:-gpu}" "${contenders[@]}" --work-dir "$WORK_ROOT/bench-$name" --out "$OUT/bench-$name.json" > "$OUT/bench-$name.log" 2>&1
    local code=$?
    tail -n 30 "$WORK_ROOT/bench-$name"/*.log > "$OUT/server-logs-tail-$name.txt" 2>/dev/null
    gzip -c "$WORK_ROOT/bench-$name"/py-spy-raw.txt > "$OUT/py-spy-raw-$name.txt.gz" 2>/dev/null || rm -f "$OUT/py-spy-raw-$name.txt.gz"
    for trace in "$WORK_ROOT/bench-$name"/trace-*/*.trace.json.gz; do  # the trace suite's raw traces
        [ -f "$trace" ] && cp "$trace" "$OUT/$(basename "$(dirname "$trace")").trace.json.gz"
    done
    return $code
}
if [ ${#suites[@]} -gt 0 ] && [ -n "${BENCH_PARALLEL:-}" ]; then
    # BENCH_PARALLEL=1: each suite in its own process, all at once (their servers share the
    # GPU; for suites whose measurements do not overlap much, such as profile and fp8).
    pids=()
    for ((i = 1; i < ${#suites[@]}; i += 2)); do
        bench_dump "gpu-${suites[$i]}" --suite "${suites[$i]}" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    tail -c 4000 "$OUT"/bench-gpu-*.log
elif [ ${#suites[@]} -gt 0 ]; then
    bench_dump gpu "${suites[@]}" || status=1
    tail -c 8000 "$OUT/bench-gpu.log"
fi
exit "$status"
