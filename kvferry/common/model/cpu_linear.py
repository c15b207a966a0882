"""Linear layers with weights pre-packed for oneDNN, for fp32 on the CPU: MKL, PyTorch's default, picks a slow path
on AMD processors (docs/benchmarks.md). At a few rows (and on AVX2 at a decode batch's), a C product reads the same
packed panels faster (kernels/cpu/panel_matmul.c), where their layout is the one it reads: no second copy.
"""

import ctypes

import torch
from torch import nn

from kvferry.common.model.int8_linear import swap_linears
from kvferry.kernels.cpu import panel_matmul

DECODE_BATCH_HINT = 32  # the packed layout is tuned for this many rows; any row count works


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


PANEL_WIDTHS = tuple(range(8, 257, 8))  # the panel widths looked for: oneDNN's column blocks are multiples of 8


def _packed_floats(packed: torch.Tensor) -> torch.Tensor:
    """A packed weight's memory as a flat fp32 tensor: a view, no copy, valid only while packed lives."""
    count = torch.ops.mkldnn._nbytes(packed) // 4
    return torch.frombuffer(
        (ctypes.c_float * count).from_address(torch.ops.mkldnn.data_ptr(packed)), dtype=torch.float32
    )


def panel_width_of(packed: torch.Tensor, weight: torch.Tensor) -> int | None:
    """The width of the panels packed holds weight [n, k] in, when it is laid out as [ceil(n / width)][k][width]
    fp32 with zeros past column n (the layout panel_matmul.c reads); else None. Read off the packed memory itself:
    oneDNN's choice depends on the machine, the shape and the thread count."""
    try:
        floats = _packed_floats(packed)
    except (AttributeError, RuntimeError):  # a build of torch without these ops
        return None
    n, k = weight.shape
    for width in PANEL_WIDTHS:
        if floats.numel() == -(-n // width) * k * width and _holds_in_panels(floats, weight, width):
            return width
    return None


def _holds_in_panels(floats: torch.Tensor, weight: torch.Tensor, width: int) -> bool:
    """Whether floats are weight [n, k] as panels of this width, zeros past column n; a panel at a time, so that
    no copy of the whole weight is made."""
    n, k = weight.shape
    panels = floats.view(-1, k, width)
    for p, panel in enumerate(panels):
        columns = min(width, n - p * width)
        if not torch.equal(panel[:, :columns], weight[p * width : p * width + columns].t()):
            return False
        if columns < width and panel[:, columns:].any():
            return False
    return True


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        # The C product reads the packed panels where they lie (panel_matmul.max_rows), when their layout is its own
        self.panel_width = panel_width_of(packed, linear.weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.panel_width is not None and panel_matmul.handles(x2, self.panel_width):
            # The address is taken at each call: moving the module (.to, a copy) gives its buffer new memory
            panels = torch.ops.mkldnn.data_ptr(self.packed_weight)
            y = panel_matmul.matmul(x2, panels, self.panel_width, self.out_features, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear in model for a PackedLinear; returns how many were swapped."""
    return swap_linears(model, lambda name, linear: PackedLinear(linear))
