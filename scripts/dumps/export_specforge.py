"""Export a hidden-states dump to SpecForge's offline EAGLE-3 training layout.

    python -m scripts.dumps.export_specforge DUMP_DIR OUT_DIR [--samples FILE] [--layers 3,5,6]

One file per sample, in the order of the dump's samples file (idx 0, 1, ...), as SpecForge's
scripts/prepare_hidden_states.py writes them and its offline readers
(OfflineEagle3Dataset, OfflineManifestReader) read them:
OUT_DIR/rows_{g}-{g+2000}/data_{idx}.ckpt (g = idx // 2000 * 2000), a torch.save dict of

    input_ids         [T] long
    loss_mask         [T] long: the sample's loss mask
    hidden_state      [1, T, H]: the final normed state (the dump's last_hidden_state)
    aux_hidden_state  [1, T, K*H]: the dump's hidden_states, the dumped layers below L in
                      ascending order side by side: what SGLang feeds the draft (--layers
                      other than those is refused)

OUT_DIR/draft_config_values.json holds what the draft's config.json must say to be fed
these layers by the SGLang release that wrote the dump: eagle_config's
eagle_aux_hidden_state_layer_ids (computed by that release's own
set_eagle3_layers_to_capture when dumping), target_hidden_size and vocab_size. With
--draft-config FILE an existing draft config is checked against the dump first.

The samples file (default DUMP_DIR/samples.jsonl, written by scripts.dumps.generate) names
the samples and their loss masks; each sample's first file in the manifest is exported.
Without one, every manifest entry is exported with a mask of ones. A sample without a file,
or whose mask is not its token count long, is an error naming the rid, reported before
anything is written. OUT_DIR/export.jsonl maps each idx back to its rid and dump file. Each
file is written under a temporary name and renamed, so an interrupted export leaves only
complete files; running it again rewrites them.
"""

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from scripts.dump_format import load_dump
from scripts.dumps.draft_config import sglang_draft_values, write_values
from scripts.dumps.samples import export_command, layer_columns, training_samples

ROWS_PER_FOLDER = 2000
INDEX_NAME = "export.jsonl"


def sample_path(out_dir: Path, idx: int) -> Path:
    group = idx // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return out_dir / f"rows_{group}-{group + ROWS_PER_FOLDER}" / f"data_{idx}.ckpt"


def sample(dump_dir: Path, entry: dict, loss_mask: List[int], layers: Optional[List[int]]) -> Dict[str, torch.Tensor]:
    record = load_dump(str(dump_dir / entry["file"]))
    hidden_states = record.hidden_states
    if layers is not None:
        hidden_states = hidden_states[:, layer_columns(record.layer_ids, layers)]
    num_tokens, num_layers, hidden_size = hidden_states.shape
    return {
        "input_ids": record.token_ids.to(torch.long),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
        "hidden_state": record.last_hidden_state.unsqueeze(0),
        "aux_hidden_state": hidden_states.reshape(num_tokens, num_layers * hidden_size).unsqueeze(0),
    }


def save_atomically(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    torch.save(tensors, temp)
    os.replace(temp, path)


def export(dump_dir: Path, out_dir: Path, samples_file: Optional[Path] = None,
           layers: Optional[List[int]] = None, draft_config: Optional[Path] = None) -> int:
    """Write every sample in SpecForge's layout; the number written."""
    samples = training_samples(dump_dir, samples_file)
    values = None
    if samples:  # checked before anything is written
        first = load_dump(str(dump_dir / samples[0][0]["file"]))
        if layers is None:
            layers = sorted(layer for layer in first.layer_ids if layer < first.num_layers)
        layer_columns(first.layer_ids, layers)
        values = sglang_draft_values(first, layers, draft_config)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = []
    for idx, (entry, loss_mask) in enumerate(samples):
        path = sample_path(out_dir, idx)
        save_atomically(sample(dump_dir, entry, loss_mask, layers), path)
        index.append(json.dumps({"idx": idx, "rid": entry["rid"], "file": entry["file"],
                                 "path": str(path.relative_to(out_dir))}))
    (out_dir / INDEX_NAME).write_text("".join(line + "\n" for line in index), encoding="utf-8")
    if values is not None:
        write_values(out_dir, values)
    return len(samples)


def main(argv=None) -> int:
    return export_command(argv, __doc__, export, "the dumped layer ids to export as aux_hidden_state (default and only choice: "
                          "those below L, ascending, as SGLang feeds them)",
                          "")


if __name__ == "__main__":
    sys.exit(main())
