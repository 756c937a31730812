"""What a trainer's EAGLE-3 draft config must say about the target, from a dump, and the
check of an existing draft config against it, so that an export cannot be off by one.

The dump's layer ids are the residual stream entering decoder layer i (0: the embedding
output, L: the last layer's output before the final norm). SGLang feeds a draft its layers
in ascending order, from ids in its config that the dump's metadata records for the release
that wrote it (computed there by the release's own set_eagle3_layers_to_capture).
speculators names a layer by its output instead: its id k is the output of decoder layer k,
the dump's id k + 1.
"""

import json
from pathlib import Path
from typing import List, Optional

from scripts.dump_format import DumpRecord
from scripts.dumps.exporting import write_text_atomically
from scripts.toolchain.errors import ToolError

VALUES_NAME = "draft_config_values.json"


def config_layer_ids(path: Path):
    """The eagle_aux_hidden_state_layer_ids a draft config names (None: it names none),
    at the top level or under eagle_config."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ToolError(f"--draft-config {path}: not a readable JSON file: {e}")
    for holder in (config, config.get("eagle_config") or {}):
        if "eagle_aux_hidden_state_layer_ids" in holder:
            return holder["eagle_aux_hidden_state_layer_ids"]
    return None


def describe(ids) -> str:
    return "no eagle_aux_hidden_state_layer_ids (SGLang's default)" if ids is None else json.dumps(ids)


def sglang_draft_values(record: DumpRecord, exported: List[int], draft_config: Optional[Path]) -> dict:
    """The values a SpecForge (SGLang-served) draft config needs to be fed `exported`, the
    dumped layers the export puts side by side; refuses a draft config that would be fed
    other layers."""
    aux = sorted(layer for layer in record.layer_ids if layer < record.num_layers)
    version = record.metadata.get("sglang_version", "?")
    if exported != aux:
        raise ToolError(
            f"SGLang {version} feeds an EAGLE-3 draft the dumped layers below L={record.num_layers} in ascending "
            f"order, {aux}; --layers {exported} is not that, so a draft trained on it would be fed other "
            f"features at serving. Export --layers {','.join(map(str, aux))}.")
    candidates = record.eagle3_draft_layer_ids
    if not candidates:
        raise ToolError(
            f"no EAGLE-3 draft config of SGLang {version} is fed exactly the layers {aux} (the residual stream "
            f"entering each); dump layers a draft config can name, e.g. SGLang's defaults.")
    if draft_config is not None:
        named = config_layer_ids(draft_config)
        if named not in candidates:
            raise ToolError(
                f"--draft-config {draft_config} names {describe(named)}; SGLang {version} feeds such a draft "
                f"other layers than the dump's {aux} (ids here: the residual stream entering layer i; in a "
                f"draft config: what SGLang's set_eagle3_layers_to_capture makes of them). A draft fed "
                f"these layers names {' or '.join(describe(ids) for ids in candidates)}.")
    return {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": candidates[0]},
        "target_hidden_size": record.hidden_states.shape[-1],
        "vocab_size": record.vocab_size,
        "fed_layers": aux,
        "layer_convention": record.metadata.get("layer_convention"),
        "sglang_version": version,
    }


def speculators_values(record: DumpRecord, aux_layers: List[int], draft_config: Optional[Path]) -> dict:
    """The values a speculators draft config needs for an export of `aux_layers` then the
    last layer's output, in speculators' convention (id k: the output of decoder layer k);
    refuses a draft config that names other layers."""
    ids = [layer - 1 for layer in aux_layers]
    if draft_config is not None:
        named = config_layer_ids(draft_config)
        if named != ids:
            raise ToolError(
                f"--draft-config {draft_config} names {describe(named)} (speculators: the output of decoder layer "
                f"k); the export holds the dump's layers {aux_layers} (the residual stream entering layer i, "
                f"i.e. the output of layer i - 1), so a draft trained on it names {json.dumps(ids)}.")
    return {
        "eagle_aux_hidden_state_layer_ids": ids,
        "final_state": (f"the output of decoder layer {record.num_layers - 1} before the final norm (the dump's "
                        f"id {record.num_layers}), last in hidden_states"),
        "target_hidden_size": record.hidden_states.shape[-1],
        "vocab_size": record.vocab_size,
        "layer_convention": "speculators: id k is the output of decoder layer k",
    }


def write_values(out_dir: Path, values: dict) -> None:
    write_text_atomically(out_dir / VALUES_NAME, json.dumps(values, indent=2) + "\n")
