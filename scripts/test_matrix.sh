#!/bin/bash
# make test-matrix: for each release given, its unit tests, then its whole server suite
# (releases in FULL_SERVER_SUITE) or make test-warmup, the whole-suite releases first; the
# other releases' unit tests leave out the dump's own machinery (same_on_every_release),
# which the whole-suite releases run. With
# TEST_LANES > 1 the releases run in lanes side by side, the whole-suite releases one per
# lane (for hosts with cores to spare: on two cores a CPU-bound server test timed out). With more
# than one lane each release's output goes to .cache/test-matrix/<version>.log, printed
# once every lane is done. PRUNE_RUNTIMES=1 (a disk that holds one runtime at a time)
# runs one lane and removes each release's runtime after its tests.
# Usage: scripts/test_matrix.sh VERSION... (make passes FULL_SERVER_SUITE, SPECFORGE_RELEASE, TEST_LANES,
# PRUNE_RUNTIMES, SGLANG_DIR and its own command-line variables such as PYTEST_ARGS).
set -uo pipefail
make=${MAKE:-make}
lanes=${TEST_LANES:-1}
[ -n "${PRUNE_RUNTIMES:-}" ] && lanes=1
dir_arg=()
[ -n "${SGLANG_DIR:-}" ] && dir_arg=(SGLANG_DIR="$SGLANG_DIR")
whole_suite() { case " ${FULL_SERVER_SUITE:-} " in *" $1 "*) return 0;; esac; return 1; }

ordered=()
for version in "$@"; do whole_suite "$version" && ordered+=("$version"); done
for version in "$@"; do whole_suite "$version" || ordered+=("$version"); done

test_release() {  # test_release VERSION: its unit tests, then its server tests (and the acceptance smoke on SPECFORGE_RELEASE)
    local server=test-warmup markers="not same_on_every_release" acceptance=()
    whole_suite "$1" && server="test-server test-tensor-parallel" markers=
    [ "$1" = "${SPECFORGE_RELEASE:-}" ] && acceptance=(test-acceptance)
    "$make" --no-print-directory test-unit $server "${acceptance[@]}" SGLANG_VERSION="$1" UNIT_MARKERS="$markers" "${dir_arg[@]}"
    local status=$?
    [ -n "${PRUNE_RUNTIMES:-}" ] && rm -rf ".venv/sglang-$1"
    return $status
}

if [ "$lanes" -le 1 ] || [ ${#ordered[@]} -le 1 ]; then
    for version in "${ordered[@]}"; do test_release "$version" || exit 1; done
    exit 0
fi

mkdir -p .cache/test-matrix
pids=()
for ((lane = 0; lane < lanes && lane < ${#ordered[@]}; lane++)); do
    (
        for ((i = lane; i < ${#ordered[@]}; i += lanes)); do
            version=${ordered[$i]}
            test_release "$version" > ".cache/test-matrix/$version.log" 2>&1 || exit 1
        done
    ) &
    pids+=($!)
    echo "lane $((lane + 1)):$(for ((i = lane; i < ${#ordered[@]}; i += lanes)); do printf ' %s' "${ordered[$i]}"; done)"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for version in "${ordered[@]}"; do
    [ -f ".cache/test-matrix/$version.log" ] || continue
    echo "=== SGLang $version ==="
    cat ".cache/test-matrix/$version.log"
done
[ $status -eq 0 ] || echo "test-matrix: a release's tests failed (its log is above)" >&2
exit $status
