"""Linear layers with weights pre-packed for oneDNN, for fp32 on the CPU.

PyTorch's default CPU GEMM (MKL) picks a slow path on AMD processors; oneDNN with a
weight packed once in its blocked layout is faster at decode batch sizes on this project's
machines (`kvferry bench engine` shows the effect end to end; figures in docs/benchmarks.md).
"""

import torch
from torch import nn

DECODE_BATCH_HINT = 32  # the packed layout is tuned for this many rows; any row count works


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
