"""Export a hidden-states dump to SpecForge's offline EAGLE-3 training layout.

    python -m scripts.dumps.export_specforge DUMP_DIR OUT_DIR [--loss-masks masks.jsonl]

One file per manifest entry, in manifest order (idx 0, 1, ...), as SpecForge's
scripts/prepare_hidden_states.py writes them and its offline readers
(OfflineEagle3Dataset, OfflineManifestReader) read them:
OUT_DIR/rows_{g}-{g+2000}/data_{idx}.ckpt (g = idx // 2000 * 2000), a torch.save dict of

    input_ids         [T] long
    loss_mask         [T] long: the request's mask from --loss-masks, else all ones
    hidden_state      [1, T, H]: the final normed state (the dump's last_hidden_state)
    aux_hidden_state  [1, T, K*H]: the dump's hidden_states, its K layers concatenated
                      in the dump's order

--loss-masks is a JSONL file of {"rid": ..., "loss_mask": [0, 1, ...]}, one line per
request (the prompt's tokens to train on, usually the assistant's); a dumped request
without a mask, or with a mask whose length is not its token count, is an error naming
the rid, reported before anything is written. OUT_DIR/export.jsonl maps
each idx back to its rid and dump file. Each file is written under a temporary name and
renamed, so an interrupted export leaves only complete files; running it again rewrites
them.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from sglang.srt.managers.hidden_states_dump import load_dump, read_manifest
from scripts.toolchain.errors import USAGE, ToolError

ROWS_PER_FOLDER = 2000
INDEX_NAME = "export.jsonl"


def sample_path(out_dir: Path, idx: int) -> Path:
    group = idx // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return out_dir / f"rows_{group}-{group + ROWS_PER_FOLDER}" / f"data_{idx}.ckpt"


def read_loss_masks(path: Path) -> Dict[str, List[int]]:
    masks = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                rid, mask = entry["rid"], entry["loss_mask"]
            except (ValueError, KeyError, TypeError):
                raise ToolError(f'{path}:{number}: not a {{"rid": ..., "loss_mask": [...]}} line', USAGE)
            if rid in masks:
                raise ToolError(f"{path}:{number}: a second loss mask for rid {rid!r}", USAGE)
            masks[rid] = mask
    return masks


def check_loss_masks(entries: List[dict], loss_masks: Dict[str, List[int]]) -> None:
    """Before anything is written: a mask for every request, of its length."""
    for entry in entries:
        mask = loss_masks.get(entry["rid"])
        if mask is None:
            raise ToolError(f"no loss mask for rid {entry['rid']!r} ({entry['file']})")
        if len(mask) != entry["num_tokens"]:
            raise ToolError(f"the loss mask of rid {entry['rid']!r} has {len(mask)} values, "
                            f"its dump has {entry['num_tokens']} tokens ({entry['file']})")


def sample(dump_dir: Path, entry: dict, loss_mask: Optional[List[int]]) -> Dict[str, torch.Tensor]:
    record = load_dump(str(dump_dir / entry["file"]))
    num_tokens, num_layers, hidden_size = record.hidden_states.shape
    mask = torch.ones(num_tokens, dtype=torch.long) if loss_mask is None else torch.tensor(loss_mask, dtype=torch.long)
    return {
        "input_ids": record.token_ids.to(torch.long),
        "loss_mask": mask,
        "hidden_state": record.last_hidden_state.unsqueeze(0),
        "aux_hidden_state": record.hidden_states.reshape(num_tokens, num_layers * hidden_size).unsqueeze(0),
    }


def save_atomically(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    torch.save(tensors, temp)
    os.replace(temp, path)


def export(dump_dir: Path, out_dir: Path, loss_masks: Optional[Dict[str, List[int]]] = None) -> int:
    """Write every dumped request in SpecForge's layout; the number written."""
    entries = read_manifest(str(dump_dir))
    if loss_masks is not None:
        check_loss_masks(entries, loss_masks)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = []
    for idx, entry in enumerate(entries):
        path = sample_path(out_dir, idx)
        save_atomically(sample(dump_dir, entry, None if loss_masks is None else loss_masks[entry["rid"]]), path)
        index.append(json.dumps({"idx": idx, "rid": entry["rid"], "file": entry["file"],
                                 "path": str(path.relative_to(out_dir))}))
    (out_dir / INDEX_NAME).write_text("".join(line + "\n" for line in index), encoding="utf-8")
    return len(entries)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--loss-masks", type=Path, help='JSONL of {"rid": ..., "loss_mask": [...]}')
    args = parser.parse_args(argv)
    try:
        if not args.dump_dir.is_dir():
            raise ToolError(f"{args.dump_dir} is not a directory", USAGE)
        masks = read_loss_masks(args.loss_masks) if args.loss_masks else None
        count = export(args.dump_dir, args.out_dir, masks)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"exported {count} samples from {args.dump_dir} to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
