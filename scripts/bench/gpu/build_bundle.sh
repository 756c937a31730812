#!/bin/bash
# Build what the GPU machine needs to run the patched SGLang 0.5.14: one `pip install --target`
# tree packed as OUT_DIR/site.tar.xz. That machine has python 3.12 and torch 2.11.0 with CUDA,
# no network, and takes at most 64 MiB of carried files per run, the rest of the working tree
# included, so a bundle holds what one kind of run needs:
#   store (default): the Mooncake sink and a local store beside SGLang (about 60 MiB);
#   acceptance: SpecForge 0.2.0 and what it lacks there beside SGLang, no Mooncake, so that the
#     acceptance target's weights travel with it (scripts/acceptance/);
#   serve: SGLang alone, no Mooncake and no profiler (about 44 MiB), for the suites that only
#     serve and dump to files (answers, sample, regenerate), so the working tree fits beside it.
# Usage: scripts/bench/gpu/build_bundle.sh OUT_DIR [store|acceptance|serve]
set -euo pipefail
OUT=${1:?usage: build_bundle.sh OUT_DIR [store|acceptance|serve]}
KIND=${2:-store}
case "$KIND" in store|acceptance|serve) ;; *) echo "build_bundle.sh: no bundle kind $KIND (store, acceptance, serve)" >&2; exit 2;; esac
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
if [ "$KIND" = acceptance ]; then
  # SpecForge's trainer and what it needs that the image lacks (scripts/bench/gpu/acceptance-requirements.txt)
  while read -r requirement; do
    download "$WORK/wheels" "$requirement"
  done < <(grep -v '^#' scripts/bench/gpu/acceptance-requirements.txt)
  # sglang/utils.py imports IPython.display's HTML and display for notebook helpers: two names do.
  mkdir -p "$WORK/site/IPython"
  echo '"""A stand-in: SGLang imports IPython.display at module level, for notebook helpers only."""' > "$WORK/site/IPython/__init__.py"
  printf 'class HTML:\n    def __init__(self, data=None, **kwargs):\n        self.data = data\n\n\ndef display(*objects, **kwargs):\n    pass\n' \
    > "$WORK/site/IPython/display.py"
else
  while read -r requirement; do
    download "$WORK/wheels" "$requirement"
  done < <(grep -v '^#' scripts/bench/gpu/ipython-requirements.txt)
fi
if [ "$KIND" = store ]; then
  # The Mooncake sink (SGLANG_HS_DUMP_SINK=mooncake) and a store on the machine itself: Mooncake's
  # store client, master and memory client (pruned below), and hs-connectors' layout.
  download "$WORK/wheels" mooncake-transfer-engine-non-cuda==0.3.13.post1
  download "$WORK/wheels" hs-connectors==0.9.0
fi
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/wheels/*.whl
# sglang-kernel: only the sm90 ops. FlashAttention-3 (1.7 GB), FlashMLA and sm100 load lazily
# and are left out, so the GPU runs use --attention-backend triton.
(cd "$WORK/site" && unzip -q -o "$WORK"/kernel/sglang_kernel-0.4.4-*.whl \
  -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/flashmla_ops.abi3.so' 'sgl_kernel/sm100/*')
if [ "$KIND" != store ]; then
  rm -rf "$WORK/site/bin"
  find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  tar cf - -C "$WORK/site" . | xz -9 -T0 > "$OUT/site.tar.xz"
  ls -la "$OUT/site.tar.xz"
  exit 0
fi
# Of Mooncake's package only what `import mooncake.store` loads (its __init__ imports
# buffer_pool; store.so links libetcd_wrapper.so and libasio.so from its own folder, not
# engine.so), the two binaries a local store runs and its metadata server (a module, on
# aiohttp, which the image has). The transfer engine's module, its 42 MB bench, the connectors and the console scripts (their shebang names this machine's
# Python) stay out. Every library of the wheel's .libs folder is linked by store.so or a binary
# (readelf -d), the 22 MB libetcd_wrapper among them, so the folder stays whole.
MOONCAKE_KEPT=(__init__.py buffer_pool.py store.so libetcd_wrapper.so libasio.so mooncake_master mooncake_client
              http_metadata_server.py)
for entry in "$WORK/site/mooncake"/*; do
  [[ " ${MOONCAKE_KEPT[*]} " == *" $(basename "$entry") "* ]] || rm -rf "$entry"
done
# Of the scripts only py-spy (a binary), which the benchmark's profile suite runs, and links
# to the store's binaries, where scripts.online.master finds them once bin/ is on PATH.
find "$WORK/site/bin" -mindepth 1 ! -name py-spy -delete
ln -s ../mooncake/mooncake_master ../mooncake/mooncake_client "$WORK/site/bin/"
# The system libraries those link, transitively, that a bare image may lack (libibverbs.so.1,
# even for TCP, with libnl; libcurl and its own; libnuma), one file per soname in system-libs/:
# store_env.sh puts on the library path only those the GPU machine lacks. libibverbs and libnl
# come from Debian's packages (as the Makefile's rule does: this machine need not have them),
# the rest from where this machine's loader finds them. glibc's, libstdc++ and libgcc_s are
# every image's, and libssl, libcrypto, libz and libffi those of the Python that runs the
# servers there (ssl, zlib, ctypes: Ubuntu's python3.12 links them): they stay out.
IBVERBS_PACKAGES=(libibverbs1 libnl-3-200 libnl-route-3-200)
mkdir -p "$WORK/debs" "$WORK/site/system-libs"
(cd "$WORK/debs" && { apt-get download "${IBVERBS_PACKAGES[@]}" || { apt-get update -qq && apt-get download "${IBVERBS_PACKAGES[@]}"; }; })
for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$WORK/debs/tree"; done
ibverbs_path=$(find "$WORK/debs/tree" -name 'lib*.so.*' -printf '%h\n' | sort -u | paste -sd:)
linked=$(LD_LIBRARY_PATH="$ibverbs_path" ldd "$WORK/site/mooncake/store.so" "$WORK/site/mooncake/mooncake_master" \
  "$WORK/site/mooncake/mooncake_client")
if grep -q 'not found' <<< "$linked"; then
  echo "libraries Mooncake links that this machine lacks:" >&2
  grep 'not found' <<< "$linked" | sort -u >&2
  exit 1
fi
awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<< "$linked" | sort -u | while read -r soname path; do
  case "$soname" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|libresolv.so.*|librt.so.*|ld-linux-*|libstdc++.so.*|libgcc_s.so.*) ;;
    libssl.so.*|libcrypto.so.*|libz.so.*|libffi.so.*) ;;
    *) [[ "$path" == "$WORK/site/"* ]] || cp -L "$path" "$WORK/site/system-libs/$soname" ;;
  esac
done
find "$WORK/site" -name __pycache__ -type d -prune -exec rm -rf {} +
tar cf - -C "$WORK/site" . | xz -9 -T0 > "$OUT/site.tar.xz"
ls -la "$OUT/site.tar.xz"
