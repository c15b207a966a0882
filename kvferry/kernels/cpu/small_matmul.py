"""Int8 linear layers by the C function in small_matmul.c, each sum scaled back in the same pass: at a few rows on
every CPU, and at every row count on AVX2 without VNNI, where torch._int_mm is a scalar loop (docs/benchmarks.md)."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
MAX_ROWS = 4  # as in small_matmul.c: taken at 1-4 rows everywhere, faster than torch._int_mm (docs/benchmarks.md)
# No fused multiply-adds: the outlier channels' sums round as layer_ops.c's do (outlier_columns.h)
FLAGS = ("-ffp-contract=off",)
pointer, count = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "kvferry_takes_every_row_count": ([], count),
    "kvferry_matmul_i8": (
        [pointer, count, count, pointer, count, pointer, count, *[pointer] * 4, count, pointer, pointer, count],
        None,
    ),
}
_any_rows = False  # every row count, not just MAX_ROWS: where torch._int_mm has no fast path


def _read_row_counts(lib: build.Library) -> None:
    global _any_rows
    _any_rows = bool(lib.kvferry_takes_every_row_count())


_lib = build.Library(SOURCE, SIGNATURES, "torch._int_mm for int8 linear layers at a few rows", FLAGS, _read_row_counts)
enable, disable = _lib.enable, _lib.disable


def takes_every_row_count() -> bool:
    """Whether the function is loaded and the int8 linear layers call it at every row count, not just MAX_ROWS."""
    return _lib.loaded is not None and _any_rows


GROUP_ROWS, PIECE = 4, 32  # interleaved weights: groups of four rows, their 32-byte pieces side by side


def interleave(qweight: torch.Tensor) -> torch.Tensor | None:
    """qweight [n, k] int8 in the layout small_matmul.c streams fastest, [n/4, k/32, 4, 32] (its weight_at); only
    where the function takes every row count, so nothing needs the plain layout there; else None."""
    n, k = qweight.shape
    if not takes_every_row_count() or n % GROUP_ROWS or k % PIECE or qweight.device.type != "cpu":
        return None
    return qweight.reshape(n // GROUP_ROWS, GROUP_ROWS, k // PIECE, PIECE).transpose(1, 2).contiguous()


def is_interleaved(qweight: torch.Tensor) -> bool:
    """Whether a weight is in interleave's layout (4-D) rather than the plain [n, k]."""
    return qweight.dim() == 4


def plain(qweight: torch.Tensor) -> torch.Tensor:
    """The [n, k] layout of a weight, interleaved or not (for torch._int_mm, where this function is not loaded)."""
    if not is_interleaved(qweight):
        return qweight
    groups, pieces = qweight.shape[:2]
    return qweight.transpose(1, 2).reshape(groups * GROUP_ROWS, pieces * PIECE)


OUTLIER_TILE = 16  # columns of a tile of outlier weights (outlier_columns.h's outlier_at)


def tile_outliers(rows: torch.Tensor) -> torch.Tensor:
    """An int8 layer's outlier weights [count, n] fp16 in the layout that goes with interleaved weights,
    [ceil(n / 16), count, 16], zero-padded: each 16 columns one run of memory (outlier_columns.h's outlier_at)."""
    count, n = rows.shape
    tiles = -(-n // OUTLIER_TILE)
    padded = torch.zeros(count, tiles * OUTLIER_TILE, dtype=rows.dtype, device=rows.device)
    padded[:, :n] = rows
    return padded.reshape(count, tiles, OUTLIER_TILE).transpose(0, 1).contiguous()


def plain_outliers(rows: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The [count, n] layout of outlier weights, tiled or not (None: a layer without any), contiguous."""
    if rows is None or rows.dim() == 2:
        return rows
    return rows.transpose(0, 1).reshape(rows.shape[1], -1)[:, :n].contiguous()


def shape_of(qweight: torch.Tensor) -> tuple[int, int]:
    """(n, k) of a weight, interleaved or not."""
    if not is_interleaved(qweight):
        return tuple(qweight.shape)
    return qweight.shape[0] * GROUP_ROWS, qweight.shape[1] * PIECE


def handles(xq: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether the function takes int8 xq [rows, k] times qweight: as many rows as it takes, on the CPU, contiguous."""
    return (
        _lib.loaded is not None
        and xq.dim() == 2
        and 1 <= xq.shape[0]
        and (xq.shape[0] <= MAX_ROWS or _any_rows)
        and xq.dtype == qweight.dtype == torch.int8
        and xq.device.type == qweight.device.type == "cpu"
        and xq.is_contiguous()
        and qweight.is_contiguous()
    )


def weight_sums(qweight: torch.Tensor) -> torch.Tensor:
    """Each int8 weight row's sum, int32 [n]: matmul_i8 needs them (computed once per weight)."""
    return plain(qweight).sum(dim=1, dtype=torch.int32)


def matmul_i8(
    xq: torch.Tensor,
    qweight: torch.Tensor,
    sums: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    outliers: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """xq [rows, k] · qweight [n, k]ᵀ summed in int32, times row_scale [rows] and col_scale [n] -> fp32 [rows, n]:
    torch._int_mm's sums, bit for bit, then layer_ops.dequantize's scaling. sums: weight_sums(qweight). outliers:
    (x_out [rows, count] fp32, wt [count, n] fp16, tiled where qweight is interleaved) and the bias added as
    layer_ops.add_outlier_columns adds them."""
    rows, k = xq.shape
    n = shape_of(qweight)[0]
    y = torch.empty(rows, n)
    x_out, wt = outliers if outliers is not None else (None, None)
    _lib.kvferry_matmul_i8(
        xq.data_ptr(), rows, k, qweight.data_ptr(), int(is_interleaved(qweight)), sums.data_ptr(), n,
        row_scale.data_ptr(), col_scale.data_ptr(),
        None if x_out is None else x_out.data_ptr(), None if wt is None else wt.data_ptr(),
        0 if x_out is None else x_out.shape[1], None if bias is None else bias.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y
