"""The files `generate` keeps beside the dump's manifest, and the one place that pairs a
dump's files with their samples.

samples.jsonl, one line per dumped sample, appended only once the dump's manifest lists the
sample's file:

    {"rid": "a1", "line": 17, "num_tokens": 311, "loss_mask": [40, 52, 9, 210],
     "sample": "20261203T101500-1a2b3c4d-000000017.safetensors"}

`loss_mask` is run-length: counts of zeros and ones in turn, starting with zeros (0 first
when the mask starts with a one). `sample` is the sample's file, or its id in a Mooncake
store (format.sample_name of its manifest line); generate checks that the server's answer
named the same sample (meta_info["hidden_states_dump"]). rejected.jsonl, one line per record that is not a sample,
with the rid it would have had (null for a line that is no JSON object or whose id is unusable):

    {"line": 4, "rid": null, "kind": "not_json", "reason": "not JSON: Expecting value: ..."}
    {"line": 9, "rid": "a7", "kind": "no_assistant", "reason": "no assistant turn: nothing to train on"}

Lines are appended whole (one write each); a torn last line, left by a lost machine, is
skipped on reading and cut before the next append.
"""

import json
import os
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from scripts.dump_format import read_manifest
from scripts.toolchain.errors import ToolError

SAMPLES_NAME = "samples.jsonl"
REJECTED_NAME = "rejected.jsonl"


def mask_runs(mask: Iterable[int]) -> List[int]:
    runs, current, count = [], 0, 0
    for value in mask:
        value = 1 if value else 0
        if value != current:
            runs.append(count)
            current, count = value, 0
        count += 1
    runs.append(count)
    return runs


def mask_from_runs(runs: List[int]) -> List[int]:
    mask = []
    for n, count in enumerate(runs):
        mask += [n % 2] * count
    return mask


def read_lines(path: Path) -> List[dict]:
    """The complete lines of a JSON Lines file this module appends to."""
    if not path.exists():
        return []
    entries = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):  # torn by a lost machine
                break
            try:
                entries.append(json.loads(line))
            except ValueError:
                raise ToolError(f"{path}:{number}: not a JSON line: {line[:200]!r}")
    return entries


class AppendOnlyLines:
    """A JSON Lines file appended one whole line per write."""

    def __init__(self, path: Path):
        self.path = path
        self._cut_torn_line()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _cut_torn_line(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, entry: dict) -> None:
        os.write(self._fd, (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


def samples_line(rid: str, line: int, loss_mask: List[int], sample: str) -> dict:
    return {"rid": rid, "line": line, "num_tokens": len(loss_mask), "loss_mask": mask_runs(loss_mask),
            "sample": sample}


def file_manifest(dump_dir: Path) -> List[dict]:
    """The manifest entries of a dump to files; a control directory of the Mooncake sink,
    whose rows are in a store, is refused by name."""
    entries = read_manifest(str(dump_dir))
    in_store = next((entry for entry in entries if entry.get("sink") == "mooncake"), None)
    if in_store is not None:
        raise ToolError(f"{dump_dir}: the rows of {in_store['rid']!r} (and of every sample here) are in a Mooncake "
                        f"store, not in files: read them with scripts.online.stream.HiddenStatesStream")
    return entries


def training_samples(dump_dir: Path, samples_file: Optional[Path] = None) -> List[Tuple[dict, List[int]]]:
    """(manifest entry, loss mask) of every sample to train on, in the samples file's order.

    With a samples file (default: the dump's samples.jsonl, which `generate` writes): each
    sample once, its first file in the manifest, its mask from the file. Without one: every
    manifest entry, a mask of ones."""
    dump_dir = Path(dump_dir)
    entries = file_manifest(dump_dir)
    samples_file = samples_file or dump_dir / SAMPLES_NAME
    if not samples_file.exists():
        return [(entry, [1] * entry["num_tokens"]) for entry in entries]
    by_rid = {}
    for entry in entries:
        by_rid.setdefault(entry["rid"], entry)
    paired = []
    for sample in read_lines(samples_file):
        entry = by_rid.get(sample["rid"])
        if entry is None:
            raise ToolError(f"{samples_file}: the sample {sample['rid']!r} (line {sample['line']}) has no file "
                            f"in the manifest of {dump_dir}")
        mask = mask_from_runs(sample["loss_mask"])
        if len(mask) != entry["num_tokens"]:
            raise ToolError(f"the loss mask of {sample['rid']!r} has {len(mask)} values, its dump has "
                            f"{entry['num_tokens']} tokens ({entry['file']})")
        paired.append((entry, mask))
    return paired


def parse_layers(spec: Optional[str]) -> Optional[List[int]]:
    """`--layers 3,5,6` of the exports; None when not given."""
    if spec is None:
        return None
    try:
        layers = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ToolError(f"--layers {spec!r}: not a comma-separated list of layer ids", 2)
    if len(set(layers)) != len(layers) or not layers:
        raise ToolError(f"--layers {spec!r}: empty or repeated layer ids", 2)
    return layers


def layer_columns(dumped: List[int], wanted: List[int]) -> List[int]:
    """Where each wanted layer id sits in a dump's [T, K, H] hidden states."""
    missing = [layer for layer in wanted if layer not in dumped]
    if missing:
        raise ToolError(f"the dump holds the layers {dumped}, not {missing}; dump them with "
                        f"SGLANG_HS_DUMP_LAYERS (generate --dump-layers)")
    return [dumped.index(layer) for layer in wanted]
