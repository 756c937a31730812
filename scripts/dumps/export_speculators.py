"""Export a hidden-states dump to vLLM speculators' offline training layout (speculators 0.9.0).

    python -m scripts.dumps.export_speculators DUMP_DIR OUT_DIR [--samples FILE] [--layers 3,5,6] [--fp8]

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
        with --fp8, as speculators' FP8 connector (hs_connectors) writes them and its fp8
        backend (train with --hidden-states-backend fp8) reads them:
        hidden_states         [T, K+1, H] float8 e4m3
        hidden_states_scales  [T, 1, 1] float32: one scale per token across the layers

The last layer (id L in transformers' convention, `num_layers` of the dump) must therefore
be among the dumped layers: dump with e.g. SGLANG_HS_DUMP_LAYERS=3,31,59,61 for 61 layers
(generate --dump-layers). The dump's last_hidden_state is already normed and is not used.
OUT_DIR/draft_config_values.json holds what the draft config must say in speculators'
convention (id k: the output of decoder layer k, the dump's id k + 1): its
eagle_aux_hidden_state_layer_ids, the final state it expects, target_hidden_size and
vocab_size. With --draft-config FILE an existing draft config is checked first.
Rows follow the samples file (default DUMP_DIR/samples.jsonl), masks from it, each sample's
first file in the manifest; OUT_DIR/export.jsonl maps each row back to its rid.

--fp8 from an fp8 dump keeps half the bytes: the dump's scales (one per token and layer) are
undone in float32 and the states quantized again with one scale per token, as speculators
stores them; from a bf16 dump it quantizes them the same way. Without it the states are
written in the model's dtype. Killed at any moment, the same command continues where it
stopped; other arguments on the folder are refused (scripts/dumps/exporting.py).
"""

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from scripts.dump_format import FP8_ENCODING, DumpRecord, dequantize_rows, safetensors_header, tensor_bytes
from scripts.dumps.draft_config import speculators_values, write_values
from scripts.dumps.exporting import (
    claim_folder,
    describe_arguments,
    export_command,
    finished,
    finite_samples,
    load_checked,
    run_samples,
    sync,
    write_atomically,
    write_index,
)
from scripts.dumps.progress import ByteTally
from scripts.dumps.samples import layer_columns, training_samples
from scripts.toolchain.errors import USAGE, ToolError

HIDDEN_STATES_DIR = "hidden_states"


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


def speculators_tensors(record: DumpRecord, picked: List[int], fp8: bool) -> Dict[str, torch.Tensor]:
    """A file's tensors for speculators: the picked layers as they are (a record read
    dequantized), or with `fp8` (a record read raw) in speculators' fp8 form, float8 e4m3
    with one float32 scale per token across the layers, quantized by its own function."""
    tensors = {"token_ids": record.token_ids.to(torch.int64)}
    # The dump's own tensor when every layer is taken in its order (no copy), else a gather.
    hidden_states = (record.hidden_states if picked == list(range(record.hidden_states.shape[1]))
                     else record.hidden_states.index_select(1, torch.tensor(picked)))
    if not fp8:
        tensors["hidden_states"] = hidden_states
        return tensors
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    if record.encoding == FP8_ENCODING:
        hidden_states = dequantize_rows(hidden_states, record.hidden_states_scale[:, picked], torch.float32)
    tensors["hidden_states"], tensors[SCALES_KEY] = quantize_tensor_to_fp8(hidden_states)
    return tensors


def save_safetensors(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file written straight from the tensors' memory, with no serialized copy
    (the dump's writer does the same, with the same header builder)."""
    num_tokens = tensors["token_ids"].shape[0]
    with open(path, "wb") as f:
        f.write(safetensors_header({name: [tensor] for name, tensor in tensors.items()}, num_tokens, {}))
        for tensor in tensors.values():
            f.write(tensor_bytes(tensor))


def export(dump_dir: Path, out_dir: Path, samples_file: Optional[Path] = None, aux_layers: Optional[List[int]] = None,
           draft_config: Optional[Path] = None, threads: int = 4, fp8: bool = False,
           keep_nonfinite: bool = False) -> ByteTally:
    """Write every sample in speculators' layout (or the ones an earlier run left)."""
    samples = finite_samples(training_samples(dump_dir, samples_file), keep_nonfinite)
    if not samples:
        raise ToolError(f"{dump_dir}: no samples to export")
    first = load_checked(dump_dir, samples[0][0])
    num_layers = int(first.metadata["num_layers"])
    picked = columns(first.layer_ids, num_layers, aux_layers)  # before anything is written
    exported = [first.layer_ids[i] for i in picked]
    values = speculators_values(first, exported[:-1], draft_config)
    claim_folder(out_dir, describe_arguments(dump_dir, samples_file, samples, {"--layers": exported[:-1], "--fp8": fp8}))
    paths = [hidden_states_path(out_dir, idx) for idx in range(len(samples))]

    def convert(job: Tuple[Path, dict]) -> Tuple[int, int]:
        path, entry = job
        source = dump_dir / entry["file"]
        record = load_checked(dump_dir, entry, raw=fp8)
        if record.layer_ids != first.layer_ids:
            raise ToolError(f"{entry['file']} holds the layers {record.layer_ids}, {samples[0][0]['file']} "
                            f"{first.layer_ids}: one export takes one dump configuration")
        tensors = speculators_tensors(record, picked, fp8)
        written = write_atomically(path, lambda temp: save_safetensors(tensors, temp))
        return source.stat().st_size, written

    jobs = [(path, entry) for path, (entry, _) in zip(paths, samples) if not path.exists()]
    tally = run_samples(jobs, convert, len(samples), threads)
    if not finished(out_dir):
        write_table(out_dir, paths, [mask for _, mask in samples])
        write_values(out_dir, values)
        write_index(out_dir, [{"idx": idx, "rid": entry["rid"], "file": entry["file"]}
                              for idx, (entry, _) in enumerate(samples)])
    tally.finish()
    return tally


def write_table(out_dir: Path, paths: List[Path], loss_masks: List[List[int]]) -> None:
    """The `datasets` folder speculators' ArrowDataset reads, its token ids taken from the
    exported files (every one of them exists now, whichever run wrote it)."""
    import datasets
    from safetensors import safe_open

    rows = {"input_ids": [], "loss_mask": loss_masks, "seq_len": [len(mask) for mask in loss_masks]}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            rows["input_ids"].append(f.get_tensor("token_ids").numpy())  # 8 bytes a token, not a Python int
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict(rows, features=datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    }))
    table.set_format(type="torch")
    table.save_to_disk(str(out_dir))  # rewritten whole by a run killed before the index
    for path in out_dir.iterdir():
        if path.is_file():
            sync(path)


def main(argv=None) -> int:
    return export_command(argv, __doc__, export, "the dumped layer ids to export before the last layer, in order (default: every dumped layer but the last)",
                          " (speculators' --data-path)",
                          lambda parser: parser.add_argument(
                              "--fp8", action="store_true",
                              help="float8 e4m3 states with a float32 scale per token, for speculators' "
                                   "--hidden-states-backend fp8 (half the bytes of bf16)"),
                          ["fp8"])


if __name__ == "__main__":
    sys.exit(main())
