"""fp8_rows on a host without its kernel (tests/gpu/test_fp8_rows.py checks the kernel's bits
on a GPU): CPU rows are quantized by format.quantize_rows, and a kernel that fails leaves
the process quantizing with PyTorch, said once, and the rows still come out right."""

import logging

import torch

from sglang.srt.hidden_states_dump import format, fp8_rows
from tests.unit.dump_standins import bits


def rows() -> torch.Tensor:
    torch.manual_seed(3)
    return (torch.randn(6, 2, 64) * 5).to(torch.bfloat16)


def test_cpu_rows_are_quantized_by_the_definition():
    assert not fp8_rows.kernel_applies(rows())
    q, scale = fp8_rows.quantize_rows(rows())
    expected_q, expected_scale = format.quantize_rows(rows())
    assert torch.equal(bits(q), bits(expected_q)) and torch.equal(bits(scale), bits(expected_scale))


def test_a_failing_kernel_leaves_pytorch_quantizing_and_says_so_once(monkeypatch, caplog):
    launches = []

    def failing_kernel(tensor):
        launches.append(tensor.shape)
        raise RuntimeError("fp8e4nv is not supported on this GPU")

    monkeypatch.setattr(fp8_rows, "_kernel_failed", None)
    monkeypatch.setattr(fp8_rows, "kernel_applies", lambda tensor: fp8_rows._kernel_failed is None)
    monkeypatch.setattr(fp8_rows, "_quantize_rows_in_one_pass", failing_kernel)
    expected_q, expected_scale = format.quantize_rows(rows())
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            q, scale = fp8_rows.quantize_rows(rows())
            assert torch.equal(bits(q), bits(expected_q)) and torch.equal(bits(scale), bits(expected_scale))
    assert len(launches) == 1  # tried once, then no more
    assert "fp8e4nv is not supported" in fp8_rows._kernel_failed
    assert caplog.text.count("quantized with PyTorch from now on") == 1
