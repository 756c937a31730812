"""export_speculators --fp8 from a real fp8 dump: the files are speculators' own fp8 files
(float8 e4m3 hidden_states, one float32 scale per token across the layers), about half the
bytes of the bf16 export, and speculators 0.9.0's trainer reads them through its fp8 backend
(hs_connectors 0.9.0's FP8Transfer, what `--hidden-states-backend fp8` builds) within fp8's
rounding of the same prompts dumped in bf16. The requantization error is printed per layer
(README and BENCHMARKS.md quote it)."""

import argparse

import pytest
import torch

from scripts.dump_format import load_dump, read_manifest
from scripts.dumps import export_speculators
from tests.server.dump_checks import EXPORT_DUMP_LAYERS, dump_export_prompts, relative_error

# float8 e4m3 rounds a value by at most 2**-4 of itself (test_encoding); the per-token scale
# across layers and speculators' bf16 dequantization add to it, within this.
FP8_LAYER_ERROR = 2.0**-4


@pytest.fixture(scope="module")
def fp8_dump(model_l3, tmp_path_factory):
    """The export_dump's prompts dumped in fp8 by a second server, one at a time in the same
    order: the same values before quantization."""
    return dump_export_prompts(model_l3, tmp_path_factory.mktemp("export-fp8") / "dump", SGLANG_HS_DUMP_DTYPE="fp8")


def by_rid(dump_dir):
    return {entry["rid"]: load_dump(str(dump_dir / entry["file"])) for entry in read_manifest(str(dump_dir))}


def test_speculators_fp8_backend_reads_the_fp8_export_within_fp8_rounding(export_dump, fp8_dump, tmp_path):
    from hs_connectors import FileTransfer, HiddenStatesBackend
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    out, plain = tmp_path / "fp8", tmp_path / "bf16"
    assert export_speculators.main([str(fp8_dump), str(out), "--fp8"]) == 0
    assert export_speculators.main([str(fp8_dump), str(plain)]) == 0
    bf16, dequantized = by_rid(export_dump), by_rid(fp8_dump)
    rids = [entry["rid"] for entry in read_manifest(str(fp8_dump))]
    layers = EXPORT_DUMP_LAYERS  # every dumped layer, L (3) last, as the export orders them
    order = [EXPORT_DUMP_LAYERS.index(layer) for layer in layers]

    # The files, as speculators' FP8 connector writes them, about half the bf16 export's bytes.
    fp8_bytes = plain_bytes = 0
    for i, rid in enumerate(rids):
        raw = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        num_tokens = bf16[rid].token_ids.numel()
        assert sorted(raw) == ["hidden_states", "hidden_states_scales", "token_ids"]
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states"].shape == bf16[rid].hidden_states.shape
        assert raw["hidden_states_scales"].dtype == torch.float32 and raw["hidden_states_scales"].shape == (num_tokens, 1, 1)
        fp8_bytes += (out / "hidden_states" / f"hs_{i}.safetensors").stat().st_size
        plain_bytes += (plain / "hidden_states" / f"hs_{i}.safetensors").stat().st_size
    assert fp8_bytes < 0.55 * plain_bytes, (fp8_bytes, plain_bytes)

    # The negative control: speculators' plain file backend hands the fp8 codes over as they are.
    assert FileTransfer(out / "hidden_states").get_cached(0)["hidden_states"].dtype == torch.float8_e4m3fn

    transfer = HiddenStatesBackend.registry["fp8"].from_train_args(argparse.Namespace(hidden_states_path=None), str(out))
    dataset = ArrowDataset(max_len=2048, datapath=str(out), on_missing="raise", transfer=transfer)
    assert len(dataset) == len(rids)
    read, reference, dumped = [], [], []
    for i, rid in enumerate(rids):
        tokens = bf16[rid].token_ids
        check_hidden_states(transfer.get_cached(i), tokens.tolist())
        item = dataset[i]
        assert torch.equal(item["input_ids"], tokens) and torch.equal(dequantized[rid].token_ids, tokens)
        num_tokens = tokens.numel()
        read.append(torch.cat([item["hidden_states"].reshape(num_tokens, 2, -1),
                               item["verifier_last_hidden_states"].unsqueeze(1)], dim=1))
        reference.append(bf16[rid].hidden_states[:, order])
        dumped.append(dequantized[rid].hidden_states[:, order])
    read, reference, dumped = (torch.cat(tensors) for tensors in (read, reference, dumped))
    export_errors = {layer: relative_error(read[:, k], reference[:, k]) for k, layer in enumerate(layers)}
    dump_errors = {layer: relative_error(dumped[:, k], reference[:, k]) for k, layer in enumerate(layers)}
    # What speculators' own connector would store, quantizing the bf16 values once.
    direct = dequantize_fp8_tensor(*quantize_tensor_to_fp8(reference))
    direct_errors = {layer: relative_error(direct[:, k], reference[:, k]) for k, layer in enumerate(layers)}
    print("relative error against the bf16 dump, per layer: "
          + "; ".join(f"{what} { {k: round(v, 5) for k, v in errors.items()} }" for what, errors in [
              ("the fp8 dump", dump_errors), ("speculators reading the fp8 export", export_errors),
              ("speculators' connector quantizing the bf16 values", direct_errors)]))
    assert all(error <= FP8_LAYER_ERROR for error in dump_errors.values()), dump_errors  # one computation, two dtypes
    assert all(error <= FP8_LAYER_ERROR for error in export_errors.values()), export_errors

