#!/bin/bash
# Build what the GPU machine needs to run the patched SGLang 0.5.14: one `pip install --target`
# tree packed as OUT_DIR/site.tar.xz (about 40 MiB). That machine has python 3.12 and
# torch 2.11.0 with CUDA, no network, and takes at most 64 MiB of carried files per run.
# Usage: scripts/bench/gpu/build_bundle.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: build_bundle.sh OUT_DIR}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY312=$(scripts/toolchain/find-python 3.12)
PLATFORMS=""
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${tag}_x86_64"
done
download() {  # download DIR REQUIREMENT: the cp312 / abi3 / pure wheel, no dependencies
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none $PLATFORMS --platform any -d "$1" "$2"
}
mkdir -p "$WORK/wheels" "$WORK/kernel" "$WORK/site" "$OUT"
# sglang 0.5.14 and the two packages it pins that the GPU image lacks
download "$WORK/wheels" sglang==0.5.14
download "$WORK/wheels" flashinfer_python==0.6.12
download "$WORK/kernel" sglang-kernel==0.4.4
# The rest of launch_server's import chain missing from the image, the transformers release
# sglang 0.5.14 was built against, and what this project's tools need (apply, tests).
while read -r requirement; do
  download "$WORK/wheels" "$requirement"
done < scripts/bench/gpu/bundle-requirements.txt
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/wheels/*.whl
# sglang-kernel: only the sm90 ops. FlashAttention-3 (1.7 GB), FlashMLA and sm100 load lazily
# and are left out, so the GPU runs use --attention-backend triton.
(cd "$WORK/site" && unzip -q -o "$WORK"/kernel/sglang_kernel-0.4.4-*.whl \
  -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/flashmla_ops.abi3.so' 'sgl_kernel/sm100/*')
# Of the scripts only py-spy (a binary), which the benchmark's profile suite runs.
find "$WORK/site/bin" -mindepth 1 ! -name py-spy -delete
find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
tar cf - -C "$WORK/site" . | xz -9 -T0 > "$OUT/site.tar.xz"
ls -la "$OUT/site.tar.xz"
