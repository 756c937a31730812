"""On a GPU: fp8_rows' one-pass kernel makes the bits format.quantize_rows (the definition of
the file's fp8 rows) makes, for rows as a DeepSeek-width dump holds them and for the edges
(all-zero rows, rows at fp8's limits, widths that are not a power of two); and a row the
kernel got wrong would be seen (the negative control).

Run by scripts/bench/gpu/run_checks.sh on the GPU machine; skipped where there is no GPU."""

import pytest
import torch

from scripts.dumps.server import has_gpu
from tests.unit.dump_standins import bits

pytestmark = pytest.mark.skipif(not has_gpu(), reason="needs a GPU")


def rows_of_every_kind(shape, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32)
    # Magnitudes from 1e-30 to 1e30 across rows, as a residual stream's outliers spread.
    exponents = torch.randint(-30, 31, shape[:-1], generator=generator, device="cuda").float()
    rows = rows * torch.pow(10.0, exponents).unsqueeze(-1)
    rows = rows.to(torch.bfloat16)
    flat = rows.view(-1, shape[-1])
    if flat.shape[0] >= 3:
        flat[0] = 0  # an all-zero row: scale 1
        flat[1, 0] = 448
        flat[2] = -flat[2].abs()  # only negative values
    return rows


@pytest.mark.parametrize("shape", [(4096, 3, 7168), (4096, 7168), (333, 2, 1000), (7, 5), (0, 3, 64)])
def test_the_kernel_makes_the_bits_pytorch_makes(shape):
    from sglang.srt.hidden_states_dump import format, fp8_rows

    rows = rows_of_every_kind(shape, seed=sum(shape))
    expected_q, expected_scale = format.quantize_rows(rows)
    q, scale = fp8_rows.quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and q.shape == rows.shape
    assert scale.dtype == torch.float32 and scale.shape == rows.shape[:-1]
    scales_differing = (bits(scale) != bits(expected_scale)).sum().item()
    mismatched = (bits(q) != bits(expected_q)).sum().item()
    assert (scales_differing, mismatched) == (0, 0), \
        f"{scales_differing} of {scale.numel()} scales and {mismatched} of {q.numel()} fp8 values differ"


def test_a_wrong_value_is_seen():
    from sglang.srt.hidden_states_dump import format, fp8_rows

    rows = rows_of_every_kind((64, 7168), seed=1)
    expected_q, _ = format.quantize_rows(rows)
    q, _ = fp8_rows.quantize_rows(rows)
    q.view(torch.uint8)[5, 17] ^= 1
    assert (bits(q) != bits(expected_q)).sum().item() == 1


def test_rows_the_kernel_does_not_take_go_the_pytorch_way():
    from sglang.srt.hidden_states_dump import format, fp8_rows

    wide = rows_of_every_kind((4, fp8_rows.MAX_ROW_ELEMENTS + 1), seed=2)
    for rows in (wide, wide.cpu()):
        q, scale = fp8_rows.quantize_rows(rows)
        expected_q, expected_scale = format.quantize_rows(rows)
        assert torch.equal(bits(q), bits(expected_q)) and torch.equal(bits(scale), bits(expected_scale))


def test_a_servers_fp8_dump_is_its_bf16_dump_quantized(tmp_path):
    # Two servers, one prompt: the fp8 file (the kernel on the copier's stream) holds
    # exactly what format.quantize_rows makes of the bf16 file's rows, on the CPU.
    import random

    from scripts.dump_format import load_dump
    from scripts.dumps.server import Server, runtime_env, wait_for_manifest
    from scripts.dumps.tiny_model import ensure_model
    from sglang.srt.hidden_states_dump import format

    model = ensure_model(layers=4, q_lora=True, widths="deepseek")
    prompt = random.Random(7).sample(range(5, 1000), 300)
    records = {}
    for dtype in ("bf16", "fp8"):
        dump_dir = tmp_path / dtype
        env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS="1,2,4",
                          SGLANG_HS_DUMP_DTYPE=dtype)
        with Server(model, tmp_path / f"server-{dtype}.log", env, ["--disable-cuda-graph"]) as server:
            server.wait_ready(timeout=400)
            server.generate(prompt, max_new_tokens=1)
            [line] = wait_for_manifest(dump_dir, 1)
            assert "quantized with PyTorch from now on" not in server.log()  # the kernel ran
        records[dtype] = load_dump(str(dump_dir / line["file"]), raw=True)
    bf16, fp8 = records["bf16"], records["fp8"]
    assert fp8.token_ids.tolist() == bf16.token_ids.tolist() == prompt
    for name in format.QUANTIZED_TENSORS:
        expected_q, expected_scale = format.quantize_rows(getattr(bf16, name))
        q, scale = getattr(fp8, name), getattr(fp8, f"{name}_scale")
        assert torch.equal(bits(scale), bits(expected_scale)), name
        mismatched = (bits(q) != bits(expected_q)).sum().item()
        assert mismatched == 0, f"{name}: {mismatched} of {q.numel()} fp8 values differ"
