"""What the dump's checksum costs: the hash alone against the writer's rate, and the writer with
and without it.

    python -m scripts.bench.checksum --dir DIR [--tokens 512] [--files 32] [--threads 1 --threads 2] --out FILE.json

1. Hash throughput on the CPU: XXH3-128 (the dump's), and hashlib's sha256 and blake2b for
   comparison, over the bytes of one 512-token DeepSeek-V3 file (29 MB, bf16), on one thread
   and on several at once (xxhash gives up the interpreter lock while it hashes, as a writer
   thread of the writer process does).
2. The dump's writer (scripts/bench/writer.py's write_dump: submit to the last manifest line,
   fsync and rename included) landing the same files on DIR's filesystem, with the checksum
   as it runs and with the checksum replaced by a constant, alternating the two each round.
Needs a patched SGLang on PYTHONPATH.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch

from scripts.bench.measure import filesystem, summary
from scripts.bench.writer import LAYER_IDS, write_dump

HASHES = {
    "xxh3_128 (the dump's)": lambda: __import__("xxhash").xxh3_128(),
    "sha256 (hashlib)": hashlib.sha256,
    "blake2b (hashlib)": hashlib.blake2b,
}


def hash_rate(new_hash, data: memoryview, threads: int, seconds: float = 1.0) -> float:
    """Bytes/s hashed by `threads` threads, each hashing `data` over and over for about `seconds`."""
    counts = [0] * threads

    def run(index: int, deadline: float) -> None:
        while time.perf_counter() < deadline:
            running = new_hash()
            running.update(data)
            running.digest()
            counts[index] += 1

    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    workers = [threading.Thread(target=run, args=(i, deadline)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) * len(data) / (time.perf_counter() - started)


def writer_rate(directory: Path, threads: int, hidden_size: int, tokens: int, files: int, checksum: bool) -> float:
    from sglang.srt.hidden_states_dump import files as files_module

    with mock.patch.object(files_module, "checksum", files_module.checksum if checksum else lambda buffers: "none"):
        seconds = write_dump(directory, threads, hidden_size, tokens, files)
    written = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    shutil.rmtree(directory)
    return written / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the filesystem the writer lands on")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--files", type=int, default=32, help="files per round and contender")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, action="append", default=None,
                        help="writer and hashing threads to measure (may repeat; default 1 and the host's cores)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    thread_counts = args.threads or sorted({1, os.cpu_count() or 1})

    file_bytes = args.tokens * (len(LAYER_IDS) + 1) * args.hidden_size * 2
    data = memoryview(torch.randint(0, 256, (file_bytes,), dtype=torch.uint8).numpy())
    hashing = {f"{name}, {n} threads": summary([hash_rate(new_hash, data, n) for _ in range(args.repeats)])
               for name, new_hash in HASHES.items() for n in thread_counts}

    args.dir.mkdir(parents=True, exist_ok=True)
    rates = {f"writer, {n} threads, {'with' if checksum else 'without'} checksum": []
             for n in thread_counts for checksum in (True, False)}
    for round_index in range(args.repeats):
        names = list(rates)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            threads, checksum = int(name.split()[1]), ", with " in name
            rates[name].append(writer_rate(args.dir / f"round{round_index}-{threads}-{checksum}", threads,
                                           args.hidden_size, args.tokens, args.files, checksum))
    results = {
        "hash bytes_per_s": hashing,
        "writer bytes_per_s": {name: summary(values) for name, values in rates.items()},
        "workload": f"{args.files} files x {args.tokens} tokens x ({len(LAYER_IDS)}+1) x {args.hidden_size} bf16 "
                    f"({file_bytes / 2**20:.1f} MiB each) per round and contender",
        "filesystem": filesystem(args.dir),
        "cpus": os.cpu_count(),
    }
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
