"""fp8 rows in one pass over GPU memory.

format.quantize_rows defines the file's fp8 rows in PyTorch: a min/max pass, a division into
a float32 temporary and a cast, about 13 bytes of device memory traffic per element, run on
the copier's stream beside the forwards. The kernel here reads each row once and writes its
fp8 bytes and its scale: 3 bytes per element, with the same bits for rows of finite values
(its scale multiplies by the same float32 reciprocal, its division rounds to nearest as
PyTorch's does).
"""

import logging
from typing import Optional, Tuple

import torch

from sglang.srt.hidden_states_dump import format

logger = logging.getLogger(__name__)

# One row is one program's block: wider rows go the PyTorch way.
MAX_ROW_ELEMENTS = 16384

try:
    import triton
    import triton.language as tl
except ImportError:  # a build without Triton quantizes with PyTorch
    triton = None

if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(rows_ptr, quantized_ptr, scale_ptr, row_len, fp8_max_reciprocal, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        mask = offsets < row_len
        x = tl.load(rows_ptr + row * row_len + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, amax * fp8_max_reciprocal, 1.0)
        quantized = tl.math.div_rn(x, scale).to(tl.float8e4nv)
        tl.store(quantized_ptr + row * row_len + offsets, quantized, mask=mask)
        tl.store(scale_ptr + row, scale)


# Why the kernel is not used in this process, once it failed (None: it has not).
_kernel_failed: Optional[str] = None


def quantize_rows(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """format.quantize_rows(rows), in one kernel on the current stream where it applies (an
    NVIDIA GPU with fp8 conversions, compute capability 8.9 or later; Triton; rows of at most
    MAX_ROW_ELEMENTS), else by format.quantize_rows. The kernel compiles on its first call
    (on the copier's thread); should that or a launch fail, this process quantizes with
    PyTorch from then on, and says so once."""
    global _kernel_failed
    if not kernel_applies(rows):
        return format.quantize_rows(rows)
    try:
        return _quantize_rows_in_one_pass(rows)
    except Exception as e:
        _kernel_failed = repr(e)
        logger.warning(f"hidden states dump: fp8 rows quantized with PyTorch from now on; the kernel failed: {e!r}")
        return format.quantize_rows(rows)


def kernel_applies(rows: torch.Tensor) -> bool:
    row_len = rows.shape[-1] if rows.dim() else 0
    return (triton is not None and _kernel_failed is None and rows.is_cuda and torch.version.hip is None
            and torch.cuda.get_device_capability(rows.device) >= (8, 9) and 0 < row_len <= MAX_ROW_ELEMENTS)


def _quantize_rows_in_one_pass(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    row_len = rows.shape[-1]
    rows = rows.contiguous()
    quantized = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device)
    scale = torch.empty(rows.shape[:-1], dtype=torch.float32, device=rows.device)
    num_rows = rows.numel() // row_len
    if num_rows:
        block = triton.next_power_of_2(row_len)
        _quantize_rows_kernel[(num_rows,)](rows, quantized, scale, row_len, 1 / format.FP8_MAX, BLOCK=block,
                                           num_warps=8 if block >= 4096 else 4)
    return quantized, scale
