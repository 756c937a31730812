"""The exports against the disk: GB/s each export moves (bytes read plus bytes written) with
1, 2, 4 and 8 threads, against `dd` reading the dump and writing as many bytes
(`conv=fsync`) on the same filesystem, the contenders alternating each round.

    python -m scripts.bench.export --dir DIR [--hidden-size 7168] [--tokens 512] [--files 32] --out FILE.json

The dump is written once by the patched SGLang's own writer (scripts/bench/writer.py):
`--files` requests of `--tokens` tokens with the layers 3, 31, 59 and 61 of a 61-layer model
in bf16 (hidden size 7168: 72 KB per token, 37 MB per 512-token file), what speculators'
export needs (SpecForge's takes the three below 61). Before every contender the dump's
pages are dropped from the page cache, so reads come from the disk; every file written is
fsynced (the exports do it before each rename). Also measured once per round at the default
threads: `export_speculators --fp8` (the bf16 dump quantized: half the bytes written) and
`export_specforge --compress` (gzip), with the bytes each writes. Needs a patched SGLang on
PYTHONPATH (the dump's writer).
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from scripts.bench.measure import dd_rate, dd_read_seconds, drop_from_cache, filesystem, summary
from scripts.bench.writer import write_dump
from scripts.dumps import export_specforge, export_speculators
from scripts.dumps.exporting import DEFAULT_THREADS

LAYER_IDS = (3, 31, 59, 61)  # EAGLE-3's defaults for a 61-layer model, and L for speculators
DRAFT_LAYER_IDS = [[2, 30, 58]]  # what the files' metadata says an SGLang draft config names
THREAD_COUNTS = (1, 2, 4, 8)
EXPORTS = {"export_specforge": export_specforge, "export_speculators": export_speculators}
VARIANTS = {"export_speculators --fp8": (export_speculators, {"fp8": True}),
            "export_specforge --compress": (export_specforge, {"compress": True})}


def export_rate(module, dump: Path, out: Path, threads: int, options: dict) -> dict:
    """Bytes/s one export moves from a dump out of the page cache; the bytes it wrote."""
    drop_from_cache(sorted(dump.glob("*.safetensors")))
    started = time.perf_counter()
    tally = module.export(dump, out, threads=threads, **options)
    seconds = time.perf_counter() - started
    shutil.rmtree(out)
    return {"bytes_per_s": (tally.bytes_read + tally.bytes_written) / seconds, "written": tally.bytes_written}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per file")
    parser.add_argument("--files", type=int, default=32, help="files in the dump")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import datasets  # noqa: F401 (imported here, once, not inside the first contender's clock)
    import hs_connectors.fp8_utils  # noqa: F401

    args.dir.mkdir(parents=True, exist_ok=True)
    dump = args.dir / "dump"
    shutil.rmtree(dump, ignore_errors=True)
    write_dump(dump, DEFAULT_THREADS, args.hidden_size, args.tokens, args.files, LAYER_IDS, DRAFT_LAYER_IDS)
    dump_files = sorted(dump.glob("*.safetensors"))
    dump_bytes = sum(p.stat().st_size for p in dump_files)

    rates = {"dd: read the dump, write as many bytes": []}
    rates.update({f"{name}, {n} threads": [] for name in EXPORTS for n in THREAD_COUNTS})
    rates.update({f"{name}, {DEFAULT_THREADS} threads": [] for name in VARIANTS})
    written = {}
    for round_index in range(args.repeats):
        names = list(rates)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            print(f"round {round_index + 1}: {name}", file=sys.stderr, flush=True)
            if name.startswith("dd"):
                read_seconds = dd_read_seconds(dump_files)
                write_rate = dd_rate(args.dir, dump_bytes // 2**20)
                rates[name].append(2 * dump_bytes / (read_seconds + dump_bytes / write_rate))
                continue
            export, threads = name.rsplit(", ", 1)
            module, options = VARIANTS.get(export) or (EXPORTS[export], {})
            measured = export_rate(module, dump, args.dir / "export", int(threads.split()[0]), options)
            rates[name].append(measured["bytes_per_s"])
            written[export] = measured["written"]
    dd = rates["dd: read the dump, write as many bytes"]
    results = {
        "bytes_per_s": {name: summary(values) for name, values in rates.items()},
        "ratio to dd": {name: summary([r / d for r, d in zip(values, dd)]) for name, values in rates.items()
                        if not name.startswith("dd")},
        "bytes": {"dump (read)": dump_bytes, **{f"{export} (written)": n for export, n in written.items()}},
        "workload": f"{args.files} files x {args.tokens} tokens x ({len(LAYER_IDS)}+1) x {args.hidden_size} bf16 "
                    f"({dump_bytes / args.files / 2**20:.1f} MiB each), read past the page cache; every file "
                    f"written fsynced; GB/s = (bytes read + bytes written) / seconds",
        "filesystem": filesystem(args.dir),
        "cpus": os.cpu_count(),
    }
    shutil.rmtree(dump)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
