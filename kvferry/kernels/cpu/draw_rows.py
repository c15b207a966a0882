"""The plain rows' draw (common/model/sampler.py) on the CPU by the C function in draw_rows.c: each row's maximum,
its weights' sums per block and one block's weights again, in one call, where PyTorch's softmax, block sums and
searches each write a [rows, vocab] temporary."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
ARGTYPES = [pointer, size, pointer, count, count, count, pointer, pointer, pointer, count]
SIGNATURES = {"kvferry_draw_rows_f32": (ARGTYPES, None)}
_lib = build.Library(SOURCE, SIGNATURES, "PyTorch's plain draw (softmax, block sums, searchsorted)")
enable, disable = _lib.enable, _lib.disable


def float_rows(logits: torch.Tensor) -> bool:
    """Whether the CPU draws (this one, draw_filtered's) take these logits as they are: [N, vocab] fp32 on the CPU,
    each row contiguous."""
    return logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(1) == 1


def handles(logits: torch.Tensor) -> bool:
    """Whether the function is loaded and takes these logits (float_rows)."""
    return _lib.loaded is not None and float_rows(logits)


def draw(
    logits: torch.Tensor, rows: torch.Tensor | None, temperatures: torch.Tensor, uniforms: torch.Tensor, block: int
) -> torch.Tensor:
    """logits [N, vocab]; rows: int64 [R], which rows to draw (None: all N, R = N); temperatures float32 [R];
    uniforms float64 [R] in [0, 1) -> int64 [R] each row's token, by blocks of block tokens (sampler.py)."""
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    if rows is not None:
        assert rows.dtype == torch.long and rows.is_contiguous()
    assert temperatures.dtype == torch.float32 and temperatures.is_contiguous() and temperatures.shape == (num_rows,)
    assert uniforms.dtype == torch.float64 and uniforms.is_contiguous() and uniforms.shape == (num_rows,)
    tokens = torch.empty(num_rows, dtype=torch.long)
    _lib.kvferry_draw_rows_f32(
        logits.data_ptr(), logits.stride(0), None if rows is None else rows.data_ptr(), num_rows, logits.shape[1],
        block, temperatures.data_ptr(), uniforms.data_ptr(), tokens.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return tokens
