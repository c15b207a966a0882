"""4-bit linear layers by the C function in int4_matmul.c: int8 activation rows times 4-bit weight groups, each
group's sum scaled in the same pass, at every row count (there is no PyTorch kernel for this format)."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-ffp-contract=off",)  # the outlier channels' sums round as layer_ops.c's do (outlier_columns.h)
GROUP, CHUNK = 32, 64  # as in int4_matmul.c: weights per scale, weights per 32 packed bytes
pointer, count = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "kvferry_matmul_i4": (
        [pointer, count, count, pointer, pointer, pointer, count, pointer, pointer, pointer, count, pointer, pointer]
        + [count],
        count,
    ),
}
_lib = build.Library(SOURCE, SIGNATURES, "dequantized 4-bit weights in PyTorch ops", FLAGS)
enable, disable = _lib.enable, _lib.disable


def handles(xq: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether the function takes int8 rows xq [rows, k] times packed 4-bit weights: on the CPU, contiguous."""
    return (
        _lib.loaded is not None
        and xq.dim() == 2
        and xq.shape[0] >= 1
        and xq.dtype == torch.int8
        and packed.dtype == torch.uint8
        and xq.shape[1] == 2 * packed.shape[1]
        and xq.device.type == packed.device.type == "cpu"
        and xq.is_contiguous()
        and packed.is_contiguous()
    )


def matmul_i4(
    xq: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    row_scale: torch.Tensor,
    outliers: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """xq [rows, k] int8 · the 4-bit weight (packed [n, k / 2] uint8, scales and mins [n, k / 32] fp16)ᵀ, times
    row_scale [rows] -> fp32 [rows, n]; outliers (x_out [rows, count] fp32, wt [count, n] fp16) and the bias then added as
    layer_ops.add_outlier_columns adds them."""
    rows, k = xq.shape
    n = packed.shape[0]
    y = torch.empty(rows, n)
    x_out, wt = outliers if outliers is not None else (None, None)
    failed = _lib.kvferry_matmul_i4(
        xq.data_ptr(), rows, k, packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), n, row_scale.data_ptr(),
        None if x_out is None else x_out.data_ptr(), None if wt is None else wt.data_ptr(),
        0 if x_out is None else x_out.shape[1], None if bias is None else bias.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("CPU 4-bit product: no memory for its scratch")
    return y
