"""The dump writer alone: bytes/s it lands on a filesystem with 1, 2, 4, 8, 16 writer threads,
against `dd conv=fsync` to the same directory, alternating the contenders each round.

    python -m scripts.bench.writer --dir DIR [--hidden-size 7168] [--tokens 512] [--files 64] [--threads N] [--fp8] [--busy-thread] --out FILE.json

Each job is one request of `--tokens` prompt tokens with EAGLE-3's three layers and the
final state in bf16 (hidden size 7168: 57 KB per token, 29 MB per 512-token file), handed
to the patched SGLang's writer exactly as the scheduler hands it: the clock runs from the
first submit to the last manifest line, so it includes serialization, fsync and rename.
No model and no server: this isolates the disk path from prefill. Needs a patched SGLang
on PYTHONPATH.

`--busy-thread` adds each writer contender again with one more thread beside it that runs
Python without pause, as a scheduler thread launching forwards does: every system call of
a writer gives up the interpreter lock, and taking it back from such a thread is what the
writers pay inside a busy server.
"""

import argparse
import json
import os
import shutil
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from scripts.bench.measure import dd_rate, filesystem, summary, wait_for_lines
from scripts.dump_format import MANIFEST_NAME, ManifestFollower

LAYER_IDS = [3, 31, 59]  # EAGLE-3's default for a 61-layer model
NUM_MODEL_LAYERS = 61
THREAD_COUNTS = (1, 2, 4, 8, 16)


def write_dump(directory: Path, threads: int, hidden_size: int, tokens: int, files: int,
               layer_ids=tuple(LAYER_IDS), eagle3_draft_layer_ids=None, fp8: bool = False) -> float:
    """Seconds the dump's writer takes to land `files` requests of `layer_ids` in `directory`
    (a new folder), fed the way the dumper feeds it once a request's prompt is complete.
    `eagle3_draft_layer_ids`: what the files' metadata says SGLang's draft configs name.
    `fp8`: rows and scales as SGLANG_HS_DUMP_DTYPE=fp8 makes them."""
    from sglang.srt.hidden_states_dump.format import file_metadata, quantize_rows
    from sglang.srt.hidden_states_dump.host_buffers import Chunk, HostRows
    from sglang.srt.hidden_states_dump.requests import DumpRequest
    from sglang.srt.hidden_states_dump.writer import DumpWriter

    directory.mkdir()
    states = {"hidden_states": torch.randn(tokens, len(layer_ids), hidden_size).to(torch.bfloat16),
              "last_hidden_state": torch.randn(tokens, hidden_size).to(torch.bfloat16)}
    if fp8:
        for name in list(states):
            states[name], states[f"{name}_scale"] = quantize_rows(states[name])
    rows = HostRows(token_ids=torch.arange(tokens, dtype=torch.int64), ready=None, **states)
    metadata = file_metadata(list(layer_ids), NUM_MODEL_LAYERS, "bench", sglang_version="bench", series_version="bench",
                             eagle3_draft_layer_ids=eagle3_draft_layer_ids, fp8=fp8)
    writer = DumpWriter(str(directory), metadata, queue_size=files, on_full_queue="block", threads=threads,
                        manifest_name=MANIFEST_NAME)
    started = time.perf_counter()
    for i in range(files):
        writer.submit(DumpRequest(f"bench-{i}", tokens), [Chunk(rows, 0, tokens)])
    wait_for_lines(ManifestFollower(str(directory)), files, started, timeout=600)
    seconds = time.perf_counter() - started
    counters = writer.counters()
    if counters.errors:
        raise SystemExit(f"the writer failed: {counters.line()}")
    return seconds


class BusyThread:
    """While entered, a thread that runs Python code without pause: it holds the
    interpreter lock but for the hand-overs the switch interval forces."""

    def __enter__(self):
        self._running = True
        self._thread = threading.Thread(target=self._spin, name="busy", daemon=True)
        self._thread.start()
        return self

    def _spin(self):
        total = 0
        while self._running:
            total += sum(range(200))

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()


def writer_rate(directory: Path, threads: int, hidden_size: int, tokens: int, files: int, fp8: bool = False,
                busy_thread: bool = False) -> float:
    """Bytes/s landed by the dump's writer (with a busy Python thread beside it when asked)."""
    with BusyThread() if busy_thread else nullcontext():
        seconds = write_dump(directory, threads, hidden_size, tokens, files, fp8=fp8)
    written = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    shutil.rmtree(directory)
    return written / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per file")
    parser.add_argument("--files", type=int, default=64, help="files per round and contender")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, action="append", default=None,
                        help=f"writer threads to measure (may repeat; default {', '.join(map(str, THREAD_COUNTS))})")
    parser.add_argument("--fp8", action="store_true", help="fp8 rows and scales (SGLANG_HS_DUMP_DTYPE=fp8)")
    parser.add_argument("--busy-thread", action="store_true",
                        help="each writer contender also with a busy Python thread beside it")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    args.dir.mkdir(parents=True, exist_ok=True)
    file_bytes = args.tokens * (len(LAYER_IDS) + 1) * args.hidden_size * (1 if args.fp8 else 2)
    megabytes = max(1, file_bytes * args.files // 2**20)
    rates = {"dd conv=fsync": []}
    for n in args.threads or THREAD_COUNTS:
        rates[f"writer, {n} threads"] = []
        if args.busy_thread:
            rates[f"writer, {n} threads, a busy Python thread beside"] = []
    for round_index in range(args.repeats):
        names = list(rates)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if name.startswith("dd"):
                rates[name].append(dd_rate(args.dir, megabytes))
            else:
                threads = int(name.split()[1])
                busy = name.endswith("beside")
                rates[name].append(writer_rate(args.dir / f"round{round_index}-{threads}{'-busy' if busy else ''}",
                                               threads, args.hidden_size, args.tokens, args.files, args.fp8,
                                               busy_thread=busy))
    results = {
        "bytes_per_s": {name: summary(values) for name, values in rates.items()},
        "ratio to dd": {name: summary([r / d for r, d in zip(values, rates["dd conv=fsync"])])
                        for name, values in rates.items() if not name.startswith("dd")},
        "workload": f"{args.files} files x {args.tokens} tokens x ({len(LAYER_IDS)}+1) x {args.hidden_size} "
                    f"{'fp8 with a scale per row' if args.fp8 else 'bf16'} "
                    f"({file_bytes / 2**20:.1f} MiB each) per round and contender; dd writes the same bytes",
        "filesystem": filesystem(args.dir),
        "cpus": os.cpu_count(),
    }
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
