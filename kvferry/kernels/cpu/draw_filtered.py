"""The filtered rows' draw (top_k, top_p, min_p; common/model/sampler.py) on the CPU by the C function in
draw_filtered.c: each row's tries from its whole distribution, each checked against the filters, then, where none
is kept, the kept set (by heap among the top_k likeliest, or by selection on the weights' bits) and the draw over
it."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build, draw_rows

SOURCE = Path(__file__).with_suffix(".c")
pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
ARGTYPES = [pointer, size, pointer, count, count, count, pointer, pointer, pointer, pointer, pointer, pointer, count]
SIGNATURES = {"kvferry_draw_filtered_f32": (ARGTYPES, ctypes.c_int)}
_lib = build.Library(SOURCE, SIGNATURES, "PyTorch's filtered draw (topk pre-cut or full sort)")
enable, disable = _lib.enable, _lib.disable


def handles(logits: torch.Tensor) -> bool:
    """Whether the function is loaded and takes these logits (draw_rows.float_rows)."""
    return _lib.loaded is not None and draw_rows.float_rows(logits)


def _checked(t: torch.Tensor, dtype: torch.dtype, num_rows: int) -> int:
    assert t.dtype == dtype and t.is_contiguous() and t.shape == (num_rows,), (t.dtype, t.shape)
    return t.data_ptr()


def draw(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor | None,
    uniforms: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """logits [N, vocab]; rows: int64 [R], which rows to draw (None: all N, R = N); temperatures float32 [R]; top_ks
    int64 [R] (0 or less: none); top_ps float32 [R] (1: none); min_ps float32 [R] or None; uniforms float64 [R] in
    [0, 1) -> int64 [R] each row's token, drawn over its kept set by blocks of block tokens (sampler.py)."""
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    tokens = torch.empty(num_rows, dtype=torch.long)
    failed = _lib.kvferry_draw_filtered_f32(
        logits.data_ptr(), logits.stride(0), None if rows is None else _checked(rows, torch.long, num_rows),
        num_rows, logits.shape[1], block, _checked(temperatures, torch.float32, num_rows),
        _checked(top_ks, torch.long, num_rows), _checked(top_ps, torch.float32, num_rows),
        None if min_ps is None else _checked(min_ps, torch.float32, num_rows),
        _checked(uniforms, torch.float64, num_rows), tokens.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"the filtered draw's scratch ({logits.shape[1]} tokens a row) could not be allocated")
    return tokens
