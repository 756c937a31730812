"""What every export shares: its command line, its output folder, and its run over the samples.

The output folder records the arguments it is made with (export-args.json, written before
anything else), so that an export killed at any moment continues when run again with the
same arguments, and different arguments are refused before anything is written, naming the
difference. Every file is written under a temporary name (.<name>.tmp), fsynced and renamed:
a sample file that exists is complete and is not written again; a temporary one a killed
run left is written again under its name, and renamed, by the next. The index files are
written once every sample file exists, the export's own index (export.jsonl) last, so its
presence says the export is done.

Each dump file is checked against its manifest line's checksum as it is read: one whose
bytes changed is refused by name before anything of it is written. Samples whose rows hold
NaN or infinity (flagged in their manifest line) are left out, named, unless
--keep-nonfinite.

Samples are read, converted and written by a small pool of threads, several at a time (the
file names, not the order they finish in, carry the samples file's order), with a progress
bar and a summary (scripts/dumps/progress.py).
"""

import argparse
import hashlib
import json
import os
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from scripts.dump_format import CHECKSUM_FIELD, ChecksumMismatch, DumpRecord, load_dump, nonfinite_rows
from scripts.dumps.progress import ByteTally, progress_bar
from scripts.dumps.samples import mask_runs, parse_layers
from scripts.toolchain.errors import USAGE, ToolError

RECORD_NAME = "export-args.json"
INDEX_NAME = "export.jsonl"
DEFAULT_THREADS = 4


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def sync(path: Path) -> None:
    """fsync a file or a folder: a complete file, or the names a folder holds, survive a
    lost machine."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temp: Path, path: Path) -> None:
    """Make a complete temporary file durable, then give it its name."""
    sync(temp)
    os.replace(temp, path)


def write_atomically(path: Path, write: Callable[[Path], None]) -> int:
    """Write `path` through `write(temporary path)`; its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = temp_path(path)
    write(temp)
    size = temp.stat().st_size
    publish(temp, path)
    return size


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda temp: temp.write_text(text, encoding="utf-8"))


def load_checked(dump_dir: Path, entry: dict, raw: bool = False) -> DumpRecord:
    """A sample's dump file, its bytes checked against its manifest line's checksum (a line
    written before checksums: unchecked); a file whose bytes changed is refused by name."""
    try:
        return load_dump(str(dump_dir / entry["file"]), raw=raw, checksum=entry.get(CHECKSUM_FIELD))
    except ChecksumMismatch as e:
        raise ToolError(f"refusing {entry['file']} (rid {entry['rid']!r}) of {dump_dir}, nothing of it is exported: "
                        f"{e}")


def finite_samples(samples: List[Tuple[dict, List[int]]], keep_nonfinite: bool) -> List[Tuple[dict, List[int]]]:
    """The samples without rows that hold NaN or infinity (all of them with `keep_nonfinite`);
    those left out are named on stderr."""
    flagged = [entry for entry, _ in samples if nonfinite_rows(entry)]
    if keep_nonfinite or not flagged:
        return samples
    print(f"leaving out {len(flagged)} samples whose rows hold NaN or infinity (--keep-nonfinite keeps them): "
          + ", ".join(f"{entry['rid']!r} ({entry['file']}, {nonfinite_rows(entry)} rows)" for entry in flagged),
          file=sys.stderr)
    return [(entry, mask) for entry, mask in samples if not nonfinite_rows(entry)]


def samples_digest(samples: Sequence[Tuple[dict, List[int]]]) -> str:
    """What identifies the samples an export holds: each one's rid, dump file and mask."""
    digest = hashlib.sha256()
    for entry, mask in samples:
        digest.update(json.dumps([entry["rid"], entry["file"], mask_runs(mask)]).encode("utf-8") + b"\n")
    return digest.hexdigest()


def describe_arguments(dump_dir: Path, samples_file: Optional[Path], samples: Sequence[Tuple[dict, List[int]]],
                       options: Dict[str, object]) -> Dict[str, object]:
    """The record of what an export folder holds: the arguments that decide its bytes (not
    --threads or --draft-config, which change none) and the samples they resolved to."""
    return {
        "DUMP_DIR": str(dump_dir.resolve()),
        "--samples": str(samples_file.resolve()) if samples_file else None,
        **options,
        "samples": {"count": len(samples), "sha256": samples_digest(samples)},
    }


def claim_folder(out_dir: Path, arguments: Dict[str, object]) -> None:
    """Make `out_dir` the folder of an export with `arguments`: a new or empty folder gets
    the record; one that has it with the same arguments is resumed; anything else is
    refused before a byte is written."""
    record = out_dir / RECORD_NAME
    if record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ToolError(f"{record}: not readable ({e}); export into a new folder")
        differences = [f"{key}: {json.dumps(recorded.get(key))} there, {json.dumps(arguments.get(key))} now"
                       for key in sorted(set(recorded) | set(arguments)) if recorded.get(key) != arguments.get(key)]
        if differences:
            raise ToolError(f"{out_dir} holds an export made with other arguments ({'; '.join(differences)}); "
                            f"run it with the arguments it was made with to finish it, or export into a new folder")
        return  # a temporary file a killed run left is written again under the same name and renamed
    # A run killed before its record was renamed into place leaves the record's temporary file alone.
    if out_dir.exists() and (not out_dir.is_dir() or any(p != temp_path(record) for p in out_dir.iterdir())):
        raise ToolError(f"{out_dir} exists and is not an export's folder (it has no {RECORD_NAME}); "
                        f"export into a new or empty folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(record, json.dumps(arguments, indent=1) + "\n")


def run_samples(jobs: Sequence, convert: Callable[[object], Tuple[int, int]], total: int, threads: int) -> ByteTally:
    """Run `convert(job)` (bytes read, bytes written) for every job on `threads` threads, a
    bounded number in flight, with a progress bar over `total` samples (those done by an
    earlier run count as done). A job that raises stops the run (the jobs in flight end)."""
    tally = ByteTally(skipped=total - len(jobs))
    bar = progress_bar(total, initial=total - len(jobs))
    in_flight = deque()

    def collect() -> None:
        tally.add(*in_flight.popleft().result())
        bar.set_postfix_str(tally.postfix(), refresh=False)
        bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            try:
                for job in jobs:
                    in_flight.append(pool.submit(convert, job))
                    if len(in_flight) >= 2 * threads:
                        collect()
                while in_flight:
                    collect()
            except BaseException:
                for future in in_flight:  # those waiting for a thread; the pool waits for the running ones
                    future.cancel()
                raise
    finally:
        bar.close()
    return tally


def finished(out_dir: Path) -> bool:
    """Whether an export wrote its index (its last file) into `out_dir`: nothing is left to do."""
    return (out_dir / INDEX_NAME).is_file()


def write_index(out_dir: Path, lines: Sequence[dict]) -> None:
    """export.jsonl, the last file an export writes, once every file before it is durable
    under its name."""
    for folder, _, _ in os.walk(out_dir):
        sync(Path(folder))
    write_text_atomically(out_dir / INDEX_NAME, "".join(json.dumps(line) + "\n" for line in lines))
    sync(out_dir)


def export_command(argv, description: str, export, layers_help: str, done: str,
                   add_options: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
                   options: Sequence[str] = ()) -> int:
    """The command line every export shares: DUMP_DIR OUT_DIR [--samples FILE] [--layers IDS]
    [--draft-config FILE] [--threads N] [--keep-nonfinite], plus the export's own `options`
    (added by `add_options`); `export(dump_dir, out_dir, samples_file, layers, draft_config,
    threads, keep_nonfinite=, **options)` returns its ByteTally."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--samples", type=Path, help="the samples file (default: DUMP_DIR/samples.jsonl when there is one)")
    parser.add_argument("--layers", help=layers_help)
    parser.add_argument("--draft-config", type=Path,
                        help="an existing draft config.json: refused, before anything is written, when it would be fed "
                             "other layers than the export holds")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"samples read and written side by side (default {DEFAULT_THREADS})")
    parser.add_argument("--keep-nonfinite", action="store_true",
                        help="export the samples whose rows hold NaN or infinity too (default: left out, named)")
    add_options(parser)
    args = parser.parse_args(argv)
    try:
        if not args.dump_dir.is_dir():
            raise ToolError(f"{args.dump_dir} is not a directory", USAGE)
        if args.samples and not args.samples.is_file():
            raise ToolError(f"--samples {args.samples}: no such file", USAGE)
        if args.threads < 1:
            raise ToolError(f"--threads {args.threads}: at least 1", USAGE)
        tally = export(args.dump_dir, args.out_dir, args.samples, parse_layers(args.layers), args.draft_config,
                       args.threads, keep_nonfinite=args.keep_nonfinite,
                       **{name: getattr(args, name) for name in options})
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(tally.summary("exported"))
    print(f"exported {args.dump_dir} to {args.out_dir}{done}")
    return 0
