"""Export a hidden-states dump to SpecForge's offline EAGLE-3 training layout.

    python -m scripts.dumps.export_specforge DUMP_DIR OUT_DIR [--samples FILE] [--layers 3,5,6] [--compress]

One file per sample, in the order of the dump's samples file (idx 0, 1, ...), as SpecForge's
scripts/prepare_hidden_states.py writes them and its offline readers
(OfflineEagle3Dataset, OfflineManifestReader) read them:
OUT_DIR/rows_{g}-{g+2000}/data_{idx}.ckpt (g = idx // 2000 * 2000), a torch.save dict of
(with --compress gzipped, data_{idx}.ckpt.gz, which both readers also take)

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
anything is written. OUT_DIR/export.jsonl maps each idx back to its rid and dump file.

Killed at any moment, the same command continues where it stopped; other arguments on the
folder are refused (scripts/dumps/exporting.py). An fp8 dump is exported dequantized to the
model's dtype: SpecForge reads no fp8 features.
"""

import gzip
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from scripts.dumps.draft_config import sglang_draft_values, write_values
from scripts.dumps.exporting import (
    claim_folder,
    describe_arguments,
    export_command,
    finished,
    finite_samples,
    load_checked,
    run_samples,
    write_atomically,
    write_index,
)
from scripts.dumps.progress import ByteTally
from scripts.dumps.samples import layer_columns, training_samples

ROWS_PER_FOLDER = 2000
# gzip's fastest level: levels 6 and 9 save 1% more of hidden states' bytes at a third of its speed (BENCHMARKS.md).
GZIP_LEVEL = 1


def sample_path(out_dir: Path, idx: int, compress: bool = False) -> Path:
    group = idx // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return out_dir / f"rows_{group}-{group + ROWS_PER_FOLDER}" / f"data_{idx}.ckpt{'.gz' if compress else ''}"


def sample(dump_dir: Path, entry: dict, loss_mask: List[int], layers: Optional[List[int]]) -> Dict[str, torch.Tensor]:
    record = load_checked(dump_dir, entry)
    hidden_states = record.hidden_states
    if layers is not None:  # a gather: torch.save of a view would store the whole dump tensor
        hidden_states = hidden_states.index_select(1, torch.tensor(layer_columns(record.layer_ids, layers)))
    num_tokens, num_layers, hidden_size = hidden_states.shape
    return {
        "input_ids": record.token_ids.to(torch.long),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
        "hidden_state": record.last_hidden_state.unsqueeze(0),
        "aux_hidden_state": hidden_states.reshape(num_tokens, num_layers * hidden_size).unsqueeze(0),
    }


def save(tensors: Dict[str, torch.Tensor], path: Path, compress: bool) -> None:
    if not compress:
        torch.save(tensors, path)
        return
    with gzip.open(path, "wb", compresslevel=GZIP_LEVEL) as f:
        torch.save(tensors, f)


def export(dump_dir: Path, out_dir: Path, samples_file: Optional[Path] = None, layers: Optional[List[int]] = None,
           draft_config: Optional[Path] = None, threads: int = 4, compress: bool = False,
           keep_nonfinite: bool = False) -> ByteTally:
    """Write every sample in SpecForge's layout (or the ones an earlier run left)."""
    samples = finite_samples(training_samples(dump_dir, samples_file), keep_nonfinite)
    values = None
    if samples:  # checked before anything is written
        first = load_checked(dump_dir, samples[0][0])
        if layers is None:
            layers = sorted(layer for layer in first.layer_ids if layer < first.num_layers)
        layer_columns(first.layer_ids, layers)
        values = sglang_draft_values(first, layers, draft_config)
    claim_folder(out_dir, describe_arguments(dump_dir, samples_file, samples,
                                             {"--layers": layers, "--compress": compress}))
    paths = [sample_path(out_dir, idx, compress) for idx in range(len(samples))]

    def convert(job: Tuple[Path, dict, List[int]]) -> Tuple[int, int]:
        path, entry, loss_mask = job
        tensors = sample(dump_dir, entry, loss_mask, layers)
        written = write_atomically(path, lambda temp: save(tensors, temp, compress))
        return (dump_dir / entry["file"]).stat().st_size, written

    jobs = [(path, entry, mask) for path, (entry, mask) in zip(paths, samples) if not path.exists()]
    tally = run_samples(jobs, convert, len(samples), threads)
    if not finished(out_dir):
        if values is not None:
            write_values(out_dir, values)
        write_index(out_dir, [{"idx": idx, "rid": entry["rid"], "file": entry["file"],
                               "path": str(path.relative_to(out_dir))}
                              for idx, (path, (entry, _)) in enumerate(zip(paths, samples))])
    tally.finish()
    return tally


def main(argv=None) -> int:
    return export_command(argv, __doc__, export, "the dumped layer ids to export as aux_hidden_state (default and only choice: "
                          "those below L, ascending, as SGLang feeds them)", "",
                          lambda parser: parser.add_argument(
                              "--compress", action="store_true",
                              help="gzip each file (data_{idx}.ckpt.gz, which SpecForge's readers take)"),
                          ["compress"])


if __name__ == "__main__":
    sys.exit(main())
