"""SGLANG_HS_DUMP_DTYPE: states stored as they come, as bf16, or as float8 e4m3 with one
float32 scale per row (token and layer), about half the bytes; load_dump dequantizes to the
model's dtype unless asked for the raw form."""

import os

import pytest
import torch

from sglang.srt.hidden_states_dump.config import parse_dtype
from sglang.srt.hidden_states_dump.format import FP8_ENCODING, FP8_MAX, MANIFEST_NAME, dequantize_rows, file_metadata, load_dump, quantize_rows
from sglang.srt.hidden_states_dump.host_buffers import Chunk, HostRows
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.hidden_states_dump.writer import DumpWriter
from tests.unit.dump_standins import (
    final_rows,
    stand_in_metadata,
    layer_rows,
    prompt,
    run_forward,
    start_dumper,
    wait_for_manifest,
)

LAYER_IDS = [0, 2, 4]
# float8 e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2**-4 of
# itself; values below the smallest normal (2**-6 of the row's scale) by 2**-9 of it.
FP8_RELATIVE = 2.0**-4


@pytest.mark.parametrize("value, parsed", [(None, None), ("", None), ("bf16", "bf16"), ("fp8", "fp8"), ("FP8", "fp8")])
def test_parse_dtype(value, parsed):
    assert parse_dtype(value) == parsed


@pytest.mark.parametrize("value", ["fp16", "int8", "e4m3", "bfloat16 "])
def test_parse_dtype_refuses_with_the_accepted_values(value):
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_DTYPE.*bf16, fp8"):
        parse_dtype(value)


def assert_within_fp8_rounding(dequantized: torch.Tensor, original: torch.Tensor, scale: torch.Tensor):
    bound = FP8_RELATIVE * original.abs() + 2.0**-9 * scale.unsqueeze(-1) * FP8_MAX
    assert torch.all((dequantized.float() - original.float()).abs() <= bound)


def test_quantized_rows_round_trip_within_fp8_rounding():
    torch.manual_seed(0)
    rows = (torch.randn(64, 3, 256) * torch.logspace(-3, 3, 64)[:, None, None]).to(torch.bfloat16)
    rows[5, 1] = 0  # an all-zero row
    quantized, scale = quantize_rows(rows)
    assert quantized.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (64, 3) and scale[5, 1] == 1
    # Each scale is its row's largest magnitude, whichever its sign, over FP8_MAX: times
    # its float32 reciprocal, as a CUDA device computes the quotient, within an ulp of it.
    largest = rows.float().abs().amax(-1)
    assert torch.equal(scale[largest > 0], largest[largest > 0] * torch.tensor(1 / FP8_MAX, dtype=torch.float32))
    assert torch.allclose(scale[largest > 0], largest[largest > 0] / FP8_MAX, rtol=2.0**-23, atol=0)
    assert torch.equal(quantized.float().abs().amax(-1)[scale != 1], torch.full_like(scale[scale != 1], FP8_MAX))
    dequantized = dequantize_rows(quantized, scale, torch.bfloat16)
    assert dequantized.dtype == torch.bfloat16
    assert_within_fp8_rounding(dequantized, rows, scale)
    assert torch.all(dequantized[5, 1] == 0)


def test_an_fp8_dump_reads_back_dequantized_or_raw(dump_dir):
    dumper = start_dumper(dump_dir, LAYER_IDS, dtype="fp8")
    tokens = prompt(100, 7)
    run_forward(dumper, [(DumpRequest("r", 7), tokens, 0)])
    [line] = wait_for_manifest(dump_dir, ["r"])
    path = os.path.join(dump_dir, line["file"])

    raw = load_dump(path, raw=True)
    assert raw.encoding == FP8_ENCODING and raw.metadata["model_dtype"] == "float32"
    assert raw.hidden_states.dtype == raw.last_hidden_state.dtype == torch.float8_e4m3fn
    assert raw.hidden_states_scale.shape == (7, 3) and raw.last_hidden_state_scale.shape == (7,)
    assert line["dtype"] == "float8_e4m3fn"

    record = load_dump(path)
    expected = torch.stack([layer_rows(tokens, layer) for layer in LAYER_IDS], dim=1)
    assert record.hidden_states.dtype == torch.float32 and record.hidden_states_scale is None
    assert record.token_ids.tolist() == tokens
    assert_within_fp8_rounding(record.hidden_states, expected, raw.hidden_states_scale)
    assert_within_fp8_rounding(record.last_hidden_state, final_rows(tokens), raw.last_hidden_state_scale)


def test_a_bf16_dump_converts_the_model_dtype(dump_dir):
    dumper = start_dumper(dump_dir, LAYER_IDS, dtype="bf16")
    tokens = prompt(300, 4)
    run_forward(dumper, [(DumpRequest("r", 4), tokens, 0)])
    [line] = wait_for_manifest(dump_dir, ["r"])
    record = load_dump(os.path.join(dump_dir, line["file"]))
    assert record.encoding == "plain" and line["dtype"] == "bfloat16"
    expected = torch.stack([layer_rows(tokens, layer) for layer in LAYER_IDS], dim=1)
    assert torch.equal(record.hidden_states, expected.to(torch.bfloat16))


def write_one(directory, rows: HostRows, metadata) -> int:
    writer = DumpWriter(str(directory), metadata, queue_size=1, on_full_queue="block", threads=1,
                        manifest_name=MANIFEST_NAME)
    writer.submit(DumpRequest("r", rows.token_ids.shape[0]), [Chunk(rows, 0, rows.token_ids.shape[0])])
    [line] = wait_for_manifest(directory, ["r"])
    return os.path.getsize(os.path.join(directory, line["file"]))


def test_an_fp8_file_is_about_half_a_bf16_one(tmp_path):
    tokens, hidden = 64, 256
    torch.manual_seed(1)
    states = torch.randn(tokens, len(LAYER_IDS), hidden).to(torch.bfloat16)
    final = torch.randn(tokens, hidden).to(torch.bfloat16)
    token_ids = torch.arange(tokens)
    bf16 = HostRows(token_ids, states, final)
    (q_states, s_states), (q_final, s_final) = quantize_rows(states), quantize_rows(final)
    fp8 = HostRows(token_ids, q_states, q_final, hidden_states_scale=s_states, last_hidden_state_scale=s_final)
    (tmp_path / "bf16").mkdir(), (tmp_path / "fp8").mkdir()

    bf16_bytes = write_one(tmp_path / "bf16", bf16, stand_in_metadata(LAYER_IDS))
    fp8_bytes = write_one(tmp_path / "fp8", fp8, file_metadata(LAYER_IDS, 4, "m", "v", "v-1", fp8=True, model_dtype=torch.bfloat16))

    assert fp8_bytes / bf16_bytes <= 0.53, (fp8_bytes, bf16_bytes)
