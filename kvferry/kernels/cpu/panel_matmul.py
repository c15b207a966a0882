"""fp32 linear layers at a few rows (on AVX2, a decode batch's: max_rows) by the C function in panel_matmul.c, which
reads oneDNN's own packed panels (common/model/cpu_linear.py finds their layout): one stream's decode is bound by
reading the weights, which oneDNN's GEMM, tuned for a batch, does at a fraction of the memory's pace."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
MAX_ROWS = 4  # taken everywhere; past them, up to max_rows() where measured as fast as oneDNN's GEMM
pointer, count = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    "kvferry_panel_width_fits": ([count], count),
    "kvferry_panel_max_rows": ([], count),
    "kvferry_panel_matmul_f32": ([pointer, count, count, pointer, count, count, pointer, pointer, count], None),
}
_widths: frozenset[int] = frozenset()  # the panel widths the loaded function takes
_max_rows = 0  # of the loaded function


def _read_shapes(lib: build.Library) -> None:
    global _widths, _max_rows
    _widths = frozenset(width for width in range(1, 1025) if lib.kvferry_panel_width_fits(width))
    _max_rows = lib.kvferry_panel_max_rows()


_lib = build.Library(SOURCE, SIGNATURES, "oneDNN for fp32 linear layers at a few rows", on_load=_read_shapes)
enable, disable = _lib.enable, _lib.disable


def max_rows() -> int:
    """The most rows of x the loaded function takes (0: not loaded)."""
    return _max_rows if _lib.loaded is not None else 0


def takes_width(width: int) -> bool:
    """Whether the function is loaded and takes panels of this many columns (a whole number of its vectors)."""
    return _lib.loaded is not None and width in _widths


def handles(x: torch.Tensor, width: int) -> bool:
    """Whether the function takes x (fp32 [rows, k], up to max_rows(), contiguous, on the CPU) times these panels."""
    return (
        takes_width(width)
        and x.dim() == 2
        and 1 <= x.shape[0] <= _max_rows
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
    )


def matmul(x: torch.Tensor, panels: int, width: int, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, k] · W + bias -> [rows, n]; W at address panels, as [ceil(n / width)][k][width] fp32, the columns
    past n zero; bias fp32 [n] contiguous, or None. The caller keeps the panels' owner alive."""
    rows, k = x.shape
    y = torch.empty(rows, n)
    _lib.kvferry_panel_matmul_f32(
        x.data_ptr(), rows, k, panels, width, n, None if bias is None else bias.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y
