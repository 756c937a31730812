# Sourced ON the GPU machine by run_bench.sh once the bundle is unpacked in the folder given as
# $1 (build_bundle.sh): what the Mooncake sink and a local store need there, without touching
# the image's own Python or libraries. Prints what still does not load.
mooncake_site=$1
# The store's binaries and store.so link system libraries a bare image may lack; the bundle
# carries them (system-libs/). Only those this machine's loader cache lacks are linked into
# one folder, last on the library path, so none of the machine's own is replaced.
mooncake_libs=/tmp/mooncake-system-libs
rm -rf "$mooncake_libs" && mkdir -p "$mooncake_libs"
cached=$(ldconfig -p | awk 'NR > 1 {print $1}')
for lib in "$mooncake_site"/system-libs/lib*; do
    [ -e "$lib" ] && ! grep -qxF "$(basename "$lib")" <<< "$cached" && ln -s "$lib" "$mooncake_libs/"
done
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$mooncake_libs
echo "system libraries taken from the bundle: $(ls "$mooncake_libs" | tr '\n' ' ')"
# mooncake_master and mooncake_client, where scripts/online/master.py looks for them.
export PATH=$mooncake_site/bin:$PATH
# The sink's writer process runs `python -I` (store_sink.py): it sees the interpreter's own
# site-packages, never PYTHONPATH, so not the bundle's mooncake. A venv over python3 whose
# site-packages adds python3's own and then the bundle's gives it mooncake (python3's own
# packages first); from here on python3 is that venv's, so every server runs it.
mooncake_python=/tmp/mooncake-python
rm -rf "$mooncake_python"
if python3 -m venv --without-pip "$mooncake_python"; then
    {
        python3 -c 'import site; print("\n".join(f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()))'
        echo "$mooncake_site"
    } > "$("$mooncake_python/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/mooncake-bundle.pth"
    export PATH=$mooncake_python/bin:$PATH
fi
ldd "$mooncake_site"/mooncake/{store.so,mooncake_master,mooncake_client} | grep 'not found' | sort -u
python3 -I -c 'import mooncake.store' || echo "the sink's writer process cannot import mooncake.store"
