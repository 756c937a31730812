#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried (the
# acceptance bundle: scripts/bench/gpu/build_bundle.sh .devcarry acceptance): one step of the
# acceptance benchmark (python -m scripts.acceptance.run STEP ...), the bundle unpacked and the
# 0.5.14 series applied to it with this project's own toolchain. Every result and log lands in
# $OUT as the step makes it, so a step stopped at the call's limit still returns what it did.
# Usage: scripts/bench/gpu/run_acceptance.sh STEP [ARGS...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
SITE=/tmp/site
rm -rf "$SITE" && mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MAX_JOBS=16 GIT_PYTHON_REFRESH=quiet
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C "$SITE" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# Upstream's own package, kept before the series is applied: SpecForge's capture (the anchor)
# runs on it, as a SpecForge user's does.
UPSTREAM=/tmp/sglang-upstream
rm -rf "$UPSTREAM" && mkdir -p "$UPSTREAM" && cp -a "$SITE/sglang" "$UPSTREAM/"
PYTHONPATH=$SITE python3 -m scripts apply --version 0.5.14 --dir "$SITE" > /tmp/apply.log 2>&1 || { cat /tmp/apply.log; exit 3; }
# The bundle's console scripts stay behind (their shebang names the building machine's Python):
# SpecForge's command is its module, which scripts/acceptance runs as `python3 -m specforge.cli`.
export SGLANG_CHECKOUT=$SITE PYTHONPATH=$SITE:$PWD SGLANG_UPSTREAM=$UPSTREAM
python3 -m scripts.acceptance.run "$@" --out "$OUT" 2>&1 | tee "$OUT/step.log"
exit "${PIPESTATUS[0]}"
