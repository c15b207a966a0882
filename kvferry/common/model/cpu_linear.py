"""Linear layers with weights pre-packed for oneDNN, for fp32 on the CPU.

PyTorch's default CPU GEMM (MKL) picks a slow path on AMD processors; oneDNN with a
weight packed once in its blocked layout is faster at decode batch sizes on this project's
machines (`kvferry bench engine` shows the effect end to end; figures in docs/benchmarks.md).
At one to four rows (a single stream's decode) a C product reads the same packed panels faster
(kernels/cpu/panel_matmul.c), where their layout is the one it reads: no second copy of the weights.
"""

import ctypes
import functools

import torch
from torch import nn

from kvferry.kernels.cpu import panel_matmul

DECODE_BATCH_HINT = 32  # the packed layout is tuned for this many rows; any row count works


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed_floats(packed: torch.Tensor) -> torch.Tensor:
    """A packed weight's memory as a flat fp32 tensor (a view, no copy)."""
    count = torch.ops.mkldnn._nbytes(packed) // 4
    return torch.frombuffer(
        (ctypes.c_float * count).from_address(torch.ops.mkldnn.data_ptr(packed)), dtype=torch.float32
    )


def panel_width(n: int, k: int) -> int | None:
    """The width of the panels oneDNN packs an [n, k] weight into here and now, when its layout is
    [ceil(n / width)][k][width] with zeros past column n (the C product reads that layout); else None.
    oneDNN's choice depends on the machine and on the thread count (seen: 16 or 64 columns for one shape)."""
    return _probe_panel_width(n, k, torch.get_num_threads())


@functools.cache
def _probe_panel_width(n: int, k: int, threads: int) -> int | None:
    """Packs two weights of that shape whose values are their own row and column numbers, and reads them back."""
    try:
        rows = torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, k)  # 1-based: padding reads 0
        cols = torch.arange(k, dtype=torch.float32)[None, :].expand(n, k)
        packed = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), DECODE_BATCH_HINT) for w in (rows, cols)]
        got_rows, got_cols = (_packed_floats(p).clone() for p in packed)
    except (AttributeError, RuntimeError):  # no such op in this build of torch
        return None
    width = int(got_rows[: n + 1].diff().ne(1).nonzero()[0, 0]) + 1 if n > 1 else got_rows.numel() // k
    panels = -(-n // width)
    if width < 1 or got_rows.numel() != panels * k * width:
        return None
    padded = torch.zeros(panels * width)
    padded[:n] = torch.arange(1, n + 1)
    want_rows = padded.view(panels, 1, width).expand(panels, k, width)
    want_cols = torch.arange(k, dtype=torch.float32)[None, :, None] * padded.ne(0).view(panels, 1, width)
    if torch.equal(got_rows.view(panels, k, width), want_rows) and torch.equal(
        got_cols.view(panels, k, width), want_cols
    ):
        return width
    return None


def _holds_in_panels(packed: torch.Tensor, weight: torch.Tensor, width: int) -> bool:
    """Whether packed holds weight [n, k] as panels of this width."""
    n, k = weight.shape
    floats = _packed_floats(packed)
    if floats.numel() != -(-n // width) * k * width:
        return False
    return torch.equal(floats.view(-1, k, width).transpose(1, 2).reshape(-1, k)[:n], weight.float())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        # At a few rows the C product reads the packed panels where they lie, when their layout is the one it reads:
        # the probe says which layout oneDNN picks for the shape, and this weight's own panels are checked against it
        width = panel_width(self.out_features, self.in_features)
        if width is not None and not _holds_in_panels(packed, linear.weight.detach(), width):
            width = None
        self.panel_width = width

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
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
