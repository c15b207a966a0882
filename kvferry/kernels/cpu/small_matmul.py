"""Linear layers at a few rows (single-stream decode, a batch's tail) by the C functions in small_matmul.c: the
weights read straight through in nn.Linear's own layout, fp32 or int8, where oneDNN's GEMM reaches about half the
memory's read bandwidth."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
# Up to how many rows the C functions beat the GEMM library (the C code takes up to 4): each x row adds arithmetic
# per weight read, and oneDNN's fp32 GEMM catches up sooner than torch._int_mm does (docs/benchmarks.md).
MAX_ROWS = {torch.float32: 2, torch.int8: 4}
_lib = None


def enable(build_dir: Path) -> str:
    """Compile (once per machine) and load the functions; returns "" or why the GEMM library stays in use."""
    global _lib
    if _lib is None:
        pointer, count = ctypes.c_void_p, ctypes.c_int
        signatures = {
            "kvferry_small_matmul_f32": ([pointer, count, count, pointer, count, pointer, count], None),
            "kvferry_small_matmul_i8": (
                [pointer, count, count, pointer, pointer, count, pointer, pointer, pointer, count],
                None,
            ),
        }
        fallback = "the GEMM library for linear layers at a few rows"
        _lib, why = build.load_functions(SOURCE, build_dir, signatures, fallback)
        if _lib is None:
            return why
    return ""


def disable() -> None:
    """Back to the GEMM library, in this process (tests and benchmarks compare the two)."""
    global _lib
    _lib = None


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the functions are loaded and take x [rows, k] times weight [n, k]: a few rows, on the CPU, contiguous,
    fp32 times fp32 or int8 times int8."""
    return (
        _lib is not None
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def matmul_f32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, k] · weight [n, k]ᵀ -> [rows, n]."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n)
    _lib.kvferry_small_matmul_f32(x.data_ptr(), rows, k, weight.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y


def weight_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each int8 weight row's sum, int32 [n]: matmul_i8 needs them (computed once per weight)."""
    return qweight.sum(dim=1, dtype=torch.int32)


def matmul_i8(
    xq: torch.Tensor, qweight: torch.Tensor, sums: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor
) -> torch.Tensor:
    """The int8 product xq [rows, k] · qweight [n, k]ᵀ summed in int32, times row_scale [rows] and col_scale [n]
    -> fp32 [rows, n]: torch._int_mm's sums, bit for bit, then layer_ops.dequantize's scaling. sums: weight_sums(
    qweight)."""
    rows, k = xq.shape
    n = qweight.shape[0]
    y = torch.empty(rows, n)
    _lib.kvferry_small_matmul_i8(
        xq.data_ptr(), rows, k, qweight.data_ptr(), sums.data_ptr(), n, row_scale.data_ptr(), col_scale.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y
