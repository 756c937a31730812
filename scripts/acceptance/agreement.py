"""How far two folders of features in SpecForge's offline layout (data_<idx>.ckpt, the same idx
for the same record) are apart: the export of our dump against another capture of the same
records. Per feature: the fraction of elements bit-equal, the largest absolute difference, and
the relative error ||a - b|| / ||b|| over all compared samples; the tokens must be equal."""

from pathlib import Path
from typing import Dict

FEATURES = ("aux_hidden_state", "hidden_state")


def files_by_index(folder: Path) -> Dict[int, Path]:
    return {int(path.name[len("data_"):].split(".")[0]): path for path in folder.glob("rows_*/data_*.ckpt")}


def compare(ours: Path, theirs: Path, samples: int) -> dict:
    """The first `samples` records both folders hold, `theirs` the reference."""
    import torch

    ours_files, theirs_files = files_by_index(ours), files_by_index(theirs)
    shared = sorted(set(ours_files) & set(theirs_files))[:samples]
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
        b = torch.load(theirs_files[idx], weights_only=True)
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
