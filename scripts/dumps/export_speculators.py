"""Export a hidden-states dump to vLLM speculators' offline training layout (speculators 0.9.0).

    python -m scripts.dumps.export_speculators DUMP_DIR OUT_DIR [--samples FILE] [--layers 3,5,6]

What speculators' trainer reads with `--data-path OUT_DIR` (speculators/train/data.py,
ArrowDataset, its files through hs_connectors' FileTransfer):

    OUT_DIR/                     a `datasets` save_to_disk folder, torch format, one row per
                                 sample: input_ids [T], loss_mask [T], seq_len
    OUT_DIR/hidden_states/hs_{i}.safetensors   for row i:
        token_ids      [T] int64 (the trainer checks them against the row's input_ids)
        hidden_states  [T, K+1, H]: the --layers (default: every dumped layer but the last),
                       then the last decoder layer's output before the final norm, which
                       speculators takes as the verifier's last hidden state and normalises
                       itself

The last layer (id L in transformers' convention, `num_layers` of the dump) must therefore
be among the dumped layers: dump with e.g. SGLANG_HS_DUMP_LAYERS=3,31,59,61 for 61 layers
(generate --dump-layers). The dump's last_hidden_state is already normed and is not used.
OUT_DIR/draft_config_values.json holds what the draft config must say in speculators'
convention (id k: the output of decoder layer k, the dump's id k + 1): its
eagle_aux_hidden_state_layer_ids, the final state it expects, target_hidden_size and
vocab_size. With --draft-config FILE an existing draft config is checked first.
Rows follow the samples file (default DUMP_DIR/samples.jsonl), masks from it, each sample's
first file in the manifest; OUT_DIR/export.jsonl maps each row back to its rid. Files are
written under temporary names and renamed.
"""

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from scripts.dump_format import load_dump
from scripts.dumps.draft_config import speculators_values, write_values
from scripts.dumps.samples import export_command, layer_columns, training_samples
from scripts.toolchain.errors import USAGE, ToolError

HIDDEN_STATES_DIR = "hidden_states"
INDEX_NAME = "export.jsonl"


def hidden_states_path(out_dir: Path, idx: int) -> Path:
    return out_dir / HIDDEN_STATES_DIR / f"hs_{idx}.safetensors"


def columns(layer_ids: List[int], num_layers: int, aux_layers: Optional[List[int]]) -> List[int]:
    """Positions in the dump's layers of the aux layers, then of layer L."""
    if num_layers not in layer_ids:
        raise ToolError(f"speculators trains on the last layer's output before the final norm (layer id "
                        f"{num_layers} of this {num_layers}-layer model); the dump holds the layers {layer_ids}. "
                        f"Dump it too: SGLANG_HS_DUMP_LAYERS (generate --dump-layers) "
                        f"{','.join(map(str, [*layer_ids, num_layers]))}")
    if aux_layers is None:
        aux_layers = [layer for layer in layer_ids if layer != num_layers]
    if num_layers in aux_layers:
        raise ToolError(f"--layers names {num_layers}, the verifier's last layer, which is always exported last", USAGE)
    return layer_columns(layer_ids, [*aux_layers, num_layers])


def export(dump_dir: Path, out_dir: Path, samples_file: Optional[Path] = None,
           aux_layers: Optional[List[int]] = None, draft_config: Optional[Path] = None) -> int:
    import datasets
    from safetensors.torch import save_file

    samples = training_samples(dump_dir, samples_file)
    if not samples:
        raise ToolError(f"{dump_dir}: no samples to export")
    first = load_dump(str(dump_dir / samples[0][0]["file"]))
    num_layers = int(first.metadata["num_layers"])
    picked = columns(first.layer_ids, num_layers, aux_layers)  # before anything is written
    values = speculators_values(first, [first.layer_ids[i] for i in picked[:-1]], draft_config)
    (out_dir / HIDDEN_STATES_DIR).mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    index = []
    for idx, (entry, loss_mask) in enumerate(samples):
        record = load_dump(str(dump_dir / entry["file"]))
        if record.layer_ids != first.layer_ids:
            raise ToolError(f"{entry['file']} holds the layers {record.layer_ids}, {samples[0][0]['file']} "
                            f"{first.layer_ids}: one export takes one dump configuration")
        path = hidden_states_path(out_dir, idx)
        temp = path.with_name(f".{path.name}.tmp")
        save_file({"token_ids": record.token_ids.to(torch.int64).contiguous(),
                   "hidden_states": record.hidden_states[:, picked].contiguous()}, str(temp))
        os.replace(temp, path)
        rows["input_ids"].append(record.token_ids.tolist())
        rows["loss_mask"].append(loss_mask)
        rows["seq_len"].append(len(loss_mask))
        index.append(json.dumps({"idx": idx, "rid": entry["rid"], "file": entry["file"]}))
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict(rows, features=datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    }))
    table.set_format(type="torch")
    table.save_to_disk(str(out_dir))
    (out_dir / INDEX_NAME).write_text("".join(line + "\n" for line in index), encoding="utf-8")
    write_values(out_dir, values)
    return len(samples)


def main(argv=None) -> int:
    return export_command(argv, __doc__, export, "the dumped layer ids to export before the last layer, in order (default: every dumped layer but the last)",
                          " (speculators' --data-path)")


if __name__ == "__main__":
    sys.exit(main())
