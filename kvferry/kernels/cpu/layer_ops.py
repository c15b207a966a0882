"""A decoder layer's elementwise work on the CPU by the C functions in layer_ops.c: the residual add with the next
RMSNorm, RoPE in place, and SiLU·mul, one call each. PyTorch runs each as several ops, and at decode batch sizes
each op's dispatch costs more than its arithmetic."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-ffp-contract=off",)  # no fused multiply-adds: the add and RoPE round exactly as PyTorch's ops do
pointer, size, count, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "kvferry_add_rms_norm_f32": ([pointer] * 4 + [count, count, real, count], None),
    "kvferry_rope_f32": ([pointer, size, count, count, count, pointer, pointer, count], None),
    "kvferry_silu_mul_f32": ([pointer, pointer, count, count, count], None),
    "kvferry_quantize_rows_f32": ([pointer, count, count, pointer, count, pointer, pointer, pointer, count], None),
    "kvferry_dequantize_f32": ([pointer, pointer, pointer, pointer, count, count, count], None),
    "kvferry_add_outlier_columns_f32": ([pointer, count, count, pointer, pointer, count, pointer, count], None),
}
_lib = build.Library(SOURCE, SIGNATURES, "PyTorch's ops for a layer's elementwise work", FLAGS)
enable, disable = _lib.enable, _lib.disable


def handles(*tensors: torch.Tensor) -> bool:
    """Whether the functions are loaded and take these tensors: fp32 on the CPU, and contiguous."""
    return _lib.loaded is not None and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), the sum written into residual in place; without a
    residual, (rms_norm(x) * weight, x). x, residual [rows, dim]."""
    rows, dim = x.shape
    out = torch.empty_like(x)
    sum_into = None if residual is None else residual.data_ptr()
    _lib.kvferry_add_rms_norm_f32(
        x.data_ptr(), sum_into, weight.data_ptr(), out.data_ptr(), rows, dim, eps, torch.get_num_threads()
    )
    return out, (x if residual is None else residual)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [rows, heads, head_dim] in place (rows may be strided); cos and sin [rows, head_dim], contiguous."""
    rows, heads, head_dim = x.shape
    _lib.kvferry_rope_f32(
        x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(), sin.data_ptr(), torch.get_num_threads()
    )
    return x


def rope_handles(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        handles(cos, sin)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[2] % 2 == 0
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up [rows, 2 * width] holding gate then up -> [rows, width]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    _lib.kvferry_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def quantize_rows(x: torch.Tensor, outliers: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, dim] -> (int8 rows [rows, dim], each row's scale [rows, 1], the outlier channels' values
    [rows, len(outliers)]): the outlier channels (sorted int64 indices, or None) taken out and quantized as zero,
    each row to int8 with its own scale, as int8_linear.int8_rows_matmul does it in PyTorch ops."""
    rows, dim = x.shape
    count = 0 if outliers is None else len(outliers)
    xq = torch.empty(rows, dim, dtype=torch.int8)
    row_scale = torch.empty(rows, 1)
    x_out = torch.empty(rows, count)
    _lib.kvferry_quantize_rows_f32(
        x.data_ptr(),
        rows,
        dim,
        None if outliers is None else outliers.data_ptr(),
        count,
        xq.data_ptr(),
        row_scale.data_ptr(),
        x_out.data_ptr(),
        torch.get_num_threads(),
    )
    return xq, row_scale, x_out


def dequantize(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor) -> torch.Tensor:
    """An int8 GEMM's int32 [rows, cols] times each row's and each column's scale -> fp32 [rows, cols]."""
    rows, cols = acc.shape
    y = torch.empty(rows, cols)
    _lib.kvferry_dequantize_f32(
        acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(), y.data_ptr(), rows, cols, torch.get_num_threads()
    )
    return y


def add_outlier_columns(
    y: torch.Tensor, x_out: torch.Tensor, wt: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """In place: y [rows, n] += x_out [rows, count] · wt [count, n] (fp16; None: no outlier channels), then += bias
    [n] (None: none); the rest fp32, all contiguous. The same roundings as small_matmul.matmul_i8's at a few rows."""
    rows, n = y.shape
    count = 0 if wt is None else wt.shape[0]
    _lib.kvferry_add_outlier_columns_f32(
        y.data_ptr(), rows, n, x_out.data_ptr(), None if wt is None else wt.data_ptr(), count,
        None if bias is None else bias.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y
