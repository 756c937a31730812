"""SGLANG_HS_DUMP_DTYPE on the real server: an fp8 dump of one prefill against SGLang's own
bf16 values (the oracle's hooks, which a bf16 dump equals bit for bit on the CPU), about half
the bytes, read back dequantized by load_dump and checked by inspect_dump. (A bad value
stopping the server at startup is in test_warmup.)"""

import torch

from scripts.dump_format import FP8_ENCODING, load_dump
from scripts.dumps.inspect_dump import summarise
from tests.server.dump_checks import relative_error, run_one_prefill

LAYERS = [0, 1, 2, 3]
# float8 e4m3 rounds a value by at most 2**-4 of itself: a row's relative error stays below.
FP8_ROW_ERROR = 2.0**-4


def test_an_fp8_dump_is_half_the_bytes_within_fp8_rounding(model_l3, tmp_path):
    prompt, dump_dir, manifest, streams = run_one_prefill(
        model_l3, tmp_path, 3, ",".join(map(str, LAYERS)), prompt_len=300, SGLANG_HS_DUMP_DTYPE="fp8")
    [entry] = manifest
    path = dump_dir / entry["file"]
    raw = load_dump(str(path), raw=True)
    record = load_dump(str(path))
    assert entry["dtype"] == "float8_e4m3fn" and raw.encoding == FP8_ENCODING
    assert record.hidden_states.dtype == torch.bfloat16 and record.token_ids.tolist() == prompt

    errors = {str(layer): relative_error(record.hidden_states[:, k], streams[str(layer)])
              for k, layer in enumerate(LAYERS)}
    errors["last_hidden_state"] = relative_error(record.last_hidden_state, streams["last"])
    print(f"fp8 against bf16, relative error per layer: { {k: round(v, 5) for k, v in errors.items()} }")
    assert all(error <= FP8_ROW_ERROR for error in errors.values()), errors

    tokens, hidden = len(prompt), entry["hidden_size"]
    bf16_bytes = tokens * (len(LAYERS) + 1) * hidden * 2 + tokens * 8
    assert path.stat().st_size <= 0.53 * bf16_bytes, (path.stat().st_size, bf16_bytes)
    assert summarise(dump_dir).problems == []

