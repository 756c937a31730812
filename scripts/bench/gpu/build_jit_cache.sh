#!/bin/bash
# Runs ON the GPU machine, from the repository root, with .devcarry/site.tar.xz carried: builds
# the JIT kernel SGLang 0.5.14 compiles on first use and that takes minutes there (the Marlin
# MoE GEMM that serves compressed-tensors' W4A16 experts: about 8 minutes, which a server's
# first decode CUDA graph capture spends), then packs the built modules of SGLang's JIT cache
# into $OUT/jit-cache.tar.xz.* (parts of at most 15 MiB). Joined and carried as
# .devcarry/jit-cache.tar.xz, run_checks.sh unpacks it, so a server starts in a minute.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site-jit
export MAX_JOBS=16 TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
xz -dc -T0 .devcarry/site.tar.xz | tar xf - -C /tmp/site-jit
started=$(date +%s)
PYTHONPATH=/tmp/site-jit python3 -c '
import torch
from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module
_jit_moe_wna16_marlin_module(torch.bfloat16)'
echo "built in $(( $(date +%s) - started )) s"
cd "$TVM_FFI_CACHE_DIR"
find . -name '*.so' | tar cf - -T - | xz -T0 -9 | split -b 15M - "$OUT/jit-cache.tar.xz."
ls -la "$OUT"/jit-cache.tar.xz.*
