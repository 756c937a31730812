"""Summarise a hidden-states dump directory and validate every file against the manifest.

    python -m scripts.dumps.inspect_dump DUMP_DIR [--verify]

Shows a progress bar while it reads every file, then prints requests, tokens, bytes, layers
and dtype, the samples whose rows hold NaN or infinity, and how fast it read; exits 1 if a
manifest line names a file that is missing or does not match it, 0 otherwise. Files the
manifest does not name (a server killed between the rename and the manifest line) are
listed but are not errors.

--verify hashes every file's bytes again against its manifest line's checksum instead, with
a progress bar over the bytes, and exits 1 naming each file whose bytes changed, each file
a manifest names that is missing and each dump file no manifest names. A dump written
before checksums has none to check: it says so.
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from scripts.dump_format import CHECKSUM_FIELD, file_checksum, load_dump, nonfinite_rows
from scripts.dumps.progress import ByteTally, progress_bar
from scripts.dumps.samples import file_manifest
from scripts.toolchain.errors import ToolError


@dataclass
class Summary:
    requests: int = 0
    tokens: int = 0
    bytes: int = 0
    layers: set = field(default_factory=set)
    hidden_sizes: set = field(default_factory=set)
    dtypes: set = field(default_factory=set)
    conventions: set = field(default_factory=set)
    draft_layer_ids: set = field(default_factory=set)  # JSON of each entry's candidate draft configs
    problems: List[str] = field(default_factory=list)
    unlisted: List[str] = field(default_factory=list)
    nonfinite: List[str] = field(default_factory=list)  # "<file> (rid ...): N of T rows"


@dataclass
class Verification:
    """Every file of a dump hashed again against its manifest line's checksum."""

    verified: int = 0
    without_checksum: List[str] = field(default_factory=list)
    changed: List[str] = field(default_factory=list)  # "<file>: ..." of each file whose bytes changed
    missing: List[str] = field(default_factory=list)
    unlisted: List[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.changed or self.missing or self.unlisted)


def check_entry(dump_dir: Path, entry: dict) -> List[str]:
    path = dump_dir / entry["file"]
    if Path(entry["file"]).name != entry["file"]:
        return [f"{entry['file']!r}: not a plain file name"]
    if not path.is_file():
        return [f"{entry['file']}: missing"]
    try:
        record = load_dump(str(path), raw=True)  # as stored: the manifest names the stored dtype
    except Exception as e:
        return [f"{entry['file']}: does not load: {e}"]
    num_tokens, num_layers, hidden_size = record.hidden_states.shape
    expected = {
        "num_tokens": (entry["num_tokens"], num_tokens),
        "token_ids": (entry["num_tokens"], record.token_ids.numel()),
        "last_hidden_state": ((entry["num_tokens"], entry["hidden_size"]), tuple(record.last_hidden_state.shape)),
        "layers": (entry["layers"], record.layer_ids),
        "layer count": (len(entry["layers"]), num_layers),
        "hidden_size": (entry["hidden_size"], hidden_size),
        "dtype": (entry["dtype"], str(record.hidden_states.dtype).replace("torch.", "")),
        "rid": (entry["rid"], record.metadata.get("rid")),
    }
    return [f"{entry['file']}: {what}: manifest says {want!r}, file has {have!r}"
            for what, (want, have) in expected.items() if want != have]


def summarise(dump_dir: Path, tally: Optional[ByteTally] = None) -> Summary:
    """Every manifest entry checked against its file; with a `tally`, counted there (bytes
    read) behind a progress bar."""
    summary = Summary()
    listed = set()
    entries = file_manifest(dump_dir)
    bar = progress_bar(len(entries)) if tally is not None else None
    for entry in entries:
        listed.add(entry["file"])
        summary.requests += 1
        summary.tokens += entry["num_tokens"]
        summary.layers.add(tuple(entry["layers"]))
        summary.hidden_sizes.add(entry["hidden_size"])
        summary.dtypes.add(entry["dtype"])
        summary.conventions.add(entry.get("layer_convention", "-"))
        summary.draft_layer_ids.add(json.dumps(entry.get("eagle3_draft_layer_ids", [])))
        path = dump_dir / entry["file"]
        size = path.stat().st_size if path.is_file() else 0
        summary.bytes += size
        summary.problems += check_entry(dump_dir, entry)
        if nonfinite_rows(entry):
            summary.nonfinite.append(f"{entry['file']} (rid {entry['rid']!r}): {nonfinite_rows(entry)} of "
                                     f"{entry['num_tokens']} rows")
        if bar is not None:
            tally.add(size)
            bar.set_postfix_str(tally.postfix(), refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    summary.unlisted = unlisted_files(dump_dir, listed)
    return summary


def unlisted_files(dump_dir: Path, listed) -> List[str]:
    """Dump files no manifest names (a server killed between the rename and the manifest
    line); other files (the generate command's samples, logs) are not the dump's."""
    return sorted(p.name for p in dump_dir.glob("*.safetensors") if p.name not in listed)


def verify(dump_dir: Path, tally: Optional[ByteTally] = None) -> Verification:
    """Every file a manifest names hashed again against the checksum its line carries; with
    a `tally`, behind a progress bar over the bytes."""
    result = Verification()
    entries = file_manifest(dump_dir)
    paths = {entry["file"]: dump_dir / entry["file"] for entry in entries}
    total = sum(path.stat().st_size for path in paths.values() if path.is_file())
    bar = None
    if tally is not None:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    for entry in entries:
        name, path = entry["file"], paths[entry["file"]]
        if Path(name).name != name or not path.is_file():
            result.missing.append(name)
            continue
        expected = entry.get(CHECKSUM_FIELD)
        if expected is None:
            result.without_checksum.append(name)
            continue
        actual = file_checksum(str(path), expected, bar.update if bar is not None else None)
        if tally is not None:
            tally.add(path.stat().st_size)
        result.verified += 1
        if actual != expected:
            result.changed.append(f"{name} (rid {entry['rid']!r}): its bytes changed since they were written "
                                  f"(checksum {actual}, its manifest line says {expected})")
    if bar is not None:
        bar.close()
    result.unlisted = unlisted_files(dump_dir, set(paths))
    return result


def verification_report(dump_dir: Path, result: Verification) -> str:
    lines = [f"dump: {dump_dir}", f"files verified: {result.verified - len(result.changed)} of {result.verified}"]
    if result.without_checksum:
        lines.append(f"no checksum (written before the dump recorded them): {len(result.without_checksum)} files, "
                     f"not verified")
    lines += [f"CHANGED {problem}" for problem in result.changed]
    lines += [f"MISSING {name}: its manifest line names it, it is not there" for name in result.missing]
    lines += [f"UNLISTED {name}: no manifest names it" for name in result.unlisted]
    return "\n".join(lines)


def draft_configs(candidates_json: str) -> str:
    candidates = json.loads(candidates_json)
    if not candidates:
        return "none does (no draft config of this release is fed exactly these layers)"
    return " or ".join("unset (SGLang's default)" if ids is None else json.dumps(ids) for ids in candidates)


def report(dump_dir: Path, summary: Summary) -> str:
    lines = [
        f"dump: {dump_dir}",
        f"requests: {summary.requests}  tokens: {summary.tokens}  bytes: {summary.bytes}",
        f"layers: {', '.join(str(list(l)) for l in sorted(summary.layers)) or '-'}  "
        f"hidden_size: {', '.join(map(str, sorted(summary.hidden_sizes))) or '-'}  "
        f"dtype: {', '.join(sorted(summary.dtypes)) or '-'}",
        *(f"layer ids mean: {convention}" for convention in sorted(summary.conventions)),
        *(f"an SGLang EAGLE-3 draft config of this release is fed these layers (below L, ascending) "
          f"when its eagle_aux_hidden_state_layer_ids is: {draft_configs(ids)}" for ids in sorted(summary.draft_layer_ids)),
        f"files valid: {summary.requests - len({p.split(':')[0] for p in summary.problems})} of {summary.requests}",
    ]
    if summary.nonfinite:
        lines.append(f"samples with rows that hold NaN or infinity (the exports and the stream skip them): "
                     f"{len(summary.nonfinite)}")
        lines += [f"  {sample}" for sample in summary.nonfinite]
    lines += [f"PROBLEM {p}" for p in summary.problems]
    lines += [f"not in the manifest (ignored by readers): {name}" for name in summary.unlisted]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir", type=Path)
    parser.add_argument("--verify", action="store_true",
                        help="hash every file again against its manifest line's checksum")
    args = parser.parse_args(argv)
    if not args.dump_dir.is_dir():
        print(f"error: {args.dump_dir} is not a directory", file=sys.stderr)
        return 2
    tally = ByteTally()
    try:
        if args.verify:
            result = verify(args.dump_dir, tally)
            tally.finish()
            print(verification_report(args.dump_dir, result))
            print(tally.summary("hashed", "files"))
            return 1 if result.failed else 0
        summary = summarise(args.dump_dir, tally)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    tally.finish()
    print(report(args.dump_dir, summary))
    print(tally.summary("checked", "files"))
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
