"""How far two folders of features in SpecForge's offline layout (data_<idx>.ckpt) are apart:
the export of our dump against another capture of the same records. The export numbers samples
in the dump's order (the order requests finished), a reference capture in the records' order;
`record_pairs` pairs them through the export's index and the dump's samples file. Per feature:
the fraction of elements bit-equal, the largest absolute difference, and the relative error
||a - b|| / ||b|| over all compared samples; the tokens must be equal."""

import json
from pathlib import Path
from typing import Dict, Optional

FEATURES = ("aux_hidden_state", "hidden_state")


def files_by_index(folder: Path) -> Dict[int, Path]:
    return {int(path.name[len("data_"):].split(".")[0]): path for path in folder.glob("rows_*/data_*.ckpt")}


def record_pairs(export_dir: Path, dump_dir: Path) -> Dict[int, int]:
    """The export's idx -> the 0-based line of the record it was dumped from (the idx a capture
    that reads the records in order gives it)."""
    def lines(path: Path):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    record_line = {entry["rid"]: entry["line"] - 1 for entry in lines(dump_dir / "samples.jsonl")}
    return {entry["idx"]: record_line[entry["rid"]] for entry in lines(export_dir / "export.jsonl")}


def compare(ours: Path, theirs: Path, samples: int, pairs: Optional[Dict[int, int]] = None) -> dict:
    """The first `samples` records both folders hold, `theirs` the reference; `pairs` maps an
    idx of `ours` to the idx of the same record in `theirs` (by default the same idx)."""
    import torch

    ours_files, theirs_files = files_by_index(ours), files_by_index(theirs)
    pairs = pairs if pairs is not None else {idx: idx for idx in ours_files}
    shared = sorted(idx for idx in ours_files if pairs.get(idx) in theirs_files)[:samples]
    if not shared:
        raise ValueError(f"{ours} and {theirs} hold no record in common")
    equal = {name: 0 for name in FEATURES}
    elements = {name: 0 for name in FEATURES}
    largest = {name: 0.0 for name in FEATURES}
    diff_sq = {name: 0.0 for name in FEATURES}
    ref_sq = {name: 0.0 for name in FEATURES}
    token_mismatches = []
    for idx in shared:
        a = torch.load(ours_files[idx], weights_only=True)
        b = torch.load(theirs_files[pairs[idx]], weights_only=True)
        if not torch.equal(a["input_ids"], b["input_ids"]):
            token_mismatches.append(idx)
            continue
        for name in FEATURES:
            x, y = a[name].float(), b[name].float()
            if x.shape != y.shape:
                raise ValueError(f"record {idx}: {name} is {list(x.shape)} in {ours}, {list(y.shape)} in {theirs}")
            equal[name] += int((a[name] == b[name]).sum())
            elements[name] += x.numel()
            largest[name] = max(largest[name], float((x - y).abs().max()))
            diff_sq[name] += float(((x - y) ** 2).sum())
            ref_sq[name] += float((y ** 2).sum())
    return {
        "samples": len(shared), "token_mismatches": token_mismatches,
        **{name: {"bit_equal": round(equal[name] / max(elements[name], 1), 6),
                  "max_abs": largest[name],
                  "relative": (diff_sq[name] / ref_sq[name]) ** 0.5 if ref_sq[name] else None}
           for name in FEATURES},
    }
