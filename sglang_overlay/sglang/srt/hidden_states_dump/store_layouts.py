"""What the Mooncake sink puts in the store for one sample, in the layout a trainer reads.

Two layouts (SGLANG_HS_DUMP_SINK_LAYOUT):

specforge (SpecForge's online EAGLE-3 trainer: its MooncakeFeatureStore reads each tensor
    as one raw object, keyed {store_id}/{sample_id}/g{generation}/{name}, located by the
    SampleRef its StreamingRefChannel carries):
        hidden_state    [1, T, K*H]  the dumped layers side by side, in ascending order
        target          [1, T, H]    the final normed state (SpecForge's target_repr
                                     "hidden_state": the trainer runs the LM head itself)
        input_ids       [1, T]       int64
        loss_mask       [1, T]       int64
        attention_mask  [1, T]       int64, ones
    It has no place for fp8 scales, and SpecForge's reader allocates no fp8 tensors: the
    sink refuses fp8 with it (config.check_store_settings).

hs-connectors (speculators' Mooncake backend: one packed object per sample, tensors at
    64-byte-aligned offsets, described by a versioned transfer manifest; packed and put by
    hs-connectors' own packed_layout and put_sample):
        token_ids          [T] int64
        hidden_states      [T, K, H]  in the configured order
        last_hidden_state  [T, H]
        loss_mask          [T] int64
    and in fp8 hidden_states_scale [T, K] and last_hidden_state_scale [T], float32.

Every sample also gets a line in the writer's manifest (format.manifest_name) in the control
directory: the file sink's line without "file", plus where the sample is (its objects' keys,
shapes and dtypes, or its transfer manifest). That line is what HiddenStatesStream reads.

Imports nothing from sglang: the store's writer process loads it by its path.
"""

import json
from typing import Dict, List, Optional, Sequence, Tuple

# SpecForge's SampleRef schema (runtime/contracts.py, SCHEMA_VERSION) and the generation of
# every key: a sample is written once, under a key no other attempt uses.
SPECFORGE_SCHEMA_VERSION = 1
GENERATION = 1
# hs-connectors' transfer manifest version (mooncake_store.VERSION).
TRANSFER_MANIFEST_VERSION = 1
EXTRACT_MODE = "sglang-hidden-states-dump"
# The control directory's SampleRef channel (SpecForge's StreamingRefChannel file).
REF_CHANNEL = "refs.jsonl"

SampleTensors = Dict[str, Tuple[str, Tuple[int, ...]]]  # name: (dtype name, shape)


def sample_id(writer_id: Optional[str], dp_rank: int, run_id: str, sequence: int) -> str:
    """A sample's id: the writer, its data-parallel rank, the writer's run (a restarted writer
    starts a new one) and its sequence; never a request id."""
    return f"{writer_id or 'server'}-dp{dp_rank}-{run_id}-{sequence + 1:09d}"


def run_of_sample(sample: str, writer_id: Optional[str], dp_rank: int) -> Optional[str]:
    """The run of a sample id this writer (its id and data-parallel rank) made; None for
    another writer's."""
    prefix = f"{writer_id or 'server'}-dp{dp_rank}-"
    run_and_sequence = sample[len(prefix):] if sample.startswith(prefix) else ""
    run, _, sequence = run_and_sequence.rpartition("-")
    return run if run and len(sequence) == 9 and sequence.isdigit() else None


def loss_mask_values(runs: Optional[Sequence[int]], num_tokens: int) -> List[int]:
    """The loss mask a request gave, run-length encoded (zeros, ones, zeros, ...), expanded;
    every token without one. ValueError when it does not cover the prompt exactly."""
    if runs is None:
        return [1] * num_tokens
    if any(not isinstance(run, int) or isinstance(run, bool) or run < 0 for run in runs):
        raise ValueError(f"the loss mask's runs {list(runs)[:8]} are not non-negative integers")
    if sum(runs) != num_tokens:
        raise ValueError(f"the loss mask covers {sum(runs)} tokens, the prompt has {num_tokens}")
    mask: List[int] = []
    for index, run in enumerate(runs):
        mask += [index % 2] * run
    return mask


def specforge_objects(store_id: str, sample: str, tensors: SampleTensors) -> Dict[str, dict]:
    """SpecForge's objects of a sample whose dump tensors are `tensors`: name: {key, shape,
    dtype}, in put order."""
    num_tokens, num_layers, hidden_size = tensors["hidden_states"][1]
    dtype = tensors["hidden_states"][0]
    shapes = {
        "hidden_state": (dtype, [1, num_tokens, num_layers * hidden_size]),
        "target": (tensors["last_hidden_state"][0], [1, num_tokens, hidden_size]),
        "input_ids": ("int64", [1, num_tokens]),
        "loss_mask": ("int64", [1, num_tokens]),
        "attention_mask": ("int64", [1, num_tokens]),
    }
    return {
        name: {"key": f"{store_id}/{sample}/g{GENERATION}/{name}", "shape": shape, "dtype": dtype}
        for name, (dtype, shape) in shapes.items()
    }


def specforge_ref(store_id: str, sample: str, objects: Dict[str, dict], num_tokens: int,
                  metadata: Dict[str, object]) -> dict:
    """The sample's SampleRef, as SpecForge serializes one (dataclasses.asdict), for its
    StreamingRefChannel: what its ref_from_dict and MooncakeFeatureStore.get read."""
    specs = {
        name: {
            "name": name,
            "shape": list(spec["shape"]),
            "dtype": spec["dtype"],
            "device_hint": None,
            "required": True,
            "target_repr": "hidden_state" if name == "target" else None,
            "target_meta": {},
        }
        for name, spec in objects.items()
    }
    run_id = str(metadata.get("run_id", "unknown"))
    return {
        "sample_id": sample,
        "run_id": run_id,
        "source_task_id": metadata.get("rid"),
        "feature_store_uri": f"mooncake://{store_id}/{sample}",
        "feature_keys": {name: f"{sample}/{name}" for name in objects},
        "feature_specs": specs,
        "strategy": "eagle3",
        "schema_version": SPECFORGE_SCHEMA_VERSION,
        "target_model_version": str(metadata.get("model_path", "unknown")),
        "draft_weight_version": None,
        "tokenizer_version": "unknown",
        "num_tokens": num_tokens,
        "estimated_bytes": sum(object_bytes(spec) for spec in objects.values()),
        "metadata": {
            "run_id": run_id,
            "source_task_id": metadata.get("rid"),
            "strategy": "eagle3",
            "target_repr": "hidden_state",
            "vocab_map_version": None,
            "transport": "sglang_hidden_states_dump",
            "server": metadata.get("writer"),
            "generation": GENERATION,
            "layer_ids": metadata.get("layer_ids"),
        },
    }


def specforge_ref_of_line(store_id: str, line: dict, writer_id: Optional[str], run_id: str) -> dict:
    """The SampleRef of a sample from its manifest line alone (SpecForge's layout): what the
    writer publishes beside the line, and what a writer starting on the manifest publishes
    again for a line whose ref a kill left out."""
    return specforge_ref(store_id, line["sample_id"], line["objects"], line["num_tokens"],
                         dict(line, run_id=run_id, writer=writer_id))


def packed_handle(store_id: str, sample: str) -> str:
    """The key of a sample's packed object (its error marker's is this plus ":error")."""
    return f"{store_id}/{sample}"


def packed_tensors(tensors: SampleTensors) -> SampleTensors:
    """The hs-connectors layout's tensors of a sample whose dump tensors are `tensors`."""
    num_tokens = tensors["token_ids"][1][0]
    return {
        "token_ids": tensors["token_ids"],
        "hidden_states": tensors["hidden_states"],
        "last_hidden_state": tensors["last_hidden_state"],
        "loss_mask": ("int64", (num_tokens,)),
        **{name: tensors[name] for name in ("hidden_states_scale", "last_hidden_state_scale") if name in tensors},
    }


def packed_manifest(store_id: str, sample: str, tensors: SampleTensors) -> dict:
    """The transfer manifest of a sample whose dump tensors are `tensors`, its offsets by
    hs-connectors' own packed_layout."""
    import torch
    from hs_connectors.mooncake_store import packed_layout

    packed = packed_tensors(tensors)
    specs, total = packed_layout(
        {name: (tuple(shape), getattr(torch, dtype)) for name, (dtype, shape) in packed.items()}
    )
    return transfer_manifest(packed_handle(store_id, sample), specs, total, packed["loss_mask"][1][0])


def sample_location(layout: str, store_id: str, sample: str, tensors: SampleTensors,
                    layer_ids: List[int]) -> dict:
    """Where a sample is in the store, as its request's response reports it: in SpecForge's
    layout the fields of its spec_capture (store_id, sample_id, gen, aux_layer_ids, each
    feature's shape and dtype) and each object's key; in hs-connectors' its transfer manifest."""
    location = {"sink": "mooncake", "layout": layout, "store_id": store_id, "sample_id": sample}
    if layout == "specforge":
        objects = specforge_objects(store_id, sample, tensors)
        location.update(
            gen=GENERATION,
            aux_layer_ids=list(layer_ids),
            features={name: {"shape": spec["shape"], "dtype": spec["dtype"]} for name, spec in objects.items()},
            keys={name: spec["key"] for name, spec in objects.items()},
        )
    else:
        location["transfer_manifest"] = packed_manifest(store_id, sample, tensors)
    return location


def transfer_manifest(handle: str, tensor_specs: Dict[str, dict], total_bytes: int, num_tokens: int) -> dict:
    """hs-connectors' transfer manifest (version 1) of one packed object; `tensor_specs` as
    its packed_layout makes them."""
    return {
        "handle": handle,
        "version": TRANSFER_MANIFEST_VERSION,
        "tensors": {
            name: dict(spec, shape=list(spec["shape"]), dtype=str(spec["dtype"]))
            for name, spec in tensor_specs.items()
        },
        "metadata": {
            "num_tokens": num_tokens,
            "total_aligned_bytes": total_bytes,
            "extract_mode": EXTRACT_MODE,
        },
    }


DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "float8_e4m3fn": 1}


def object_bytes(spec: dict) -> int:
    size = DTYPE_SIZES[spec["dtype"]]
    for dim in spec["shape"]:
        size *= dim
    return size


def store_manifest_line(entry: dict, layout: str, sample: str, size: int, **where) -> str:
    """A sample's manifest line: the file sink's entry without its file, the sink, the
    layout, the sample id, its bytes in the store, and where it is (`objects` or
    `transfer_manifest`)."""
    line = {key: value for key, value in entry.items() if key != "file"}
    line.update(sink="mooncake", layout=layout, sample_id=sample, bytes=size, **where)
    return json.dumps(line)
