"""Int8 weights (`--quantization int8`): every linear layer's weights as int8 with one fp32 scale per output
channel (symmetric, absmax / 127), quantized at load time. Decode reads every weight once per step, so fewer bytes
(CUDA, bound by memory) or int8 arithmetic (CPU, bound by compute at batch 32) is the way past the fp32 floor.

- CUDA: a Triton kernel widens each int8 tile in registers; activations stay in the model's dtype.
- CPU: PyTorch's weight-only kernel is a matrix-vector loop, far slower from a few rows up, so each activation row
  is quantized with its own scale (a loud request costs the others no precision) and the product is an int8 GEMM
  with exact int32 sums (torch._int_mm with VNNI; our C loop at a few rows, and on AVX2 without VNNI). A few input
  channels carry activations far larger than the rest and would wipe out their precision, so the `outliers` found
  by calibration stay in float (as in LLM.int8(), fixed at load time), their weights in OUTLIER_WEIGHT_DTYPE.
  `kvferry bench quantization` measures the accuracy.
"""

import torch
from torch import nn

from kvferry.kernels.cpu import layer_ops, small_matmul

NUM_OUTLIER_CHANNELS = 32  # per layer; found by calibration (quant_calibration.py)
OUTLIER_WEIGHT_DTYPE = torch.float16  # the outlier channels' weights; their products are summed in fp32


QUANTIZE_ROWS = 1024  # rows quantized at a time: their float temporaries stay small beside the model being made


def quantize_weight(weight: torch.Tensor, zeroed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N]) with weight ~= int8 * scale[:, None]; the input channels
    `zeroed` (or none) taken as zero. QUANTIZE_ROWS rows at a time, each row alone as if all at once."""
    n, k = weight.shape
    qweight = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, device=weight.device)
    for first in range(0, n, QUANTIZE_ROWS):
        rows = slice(first, first + QUANTIZE_ROWS)
        w = weight[rows].detach().float()
        if zeroed is not None:
            w = w.index_fill(1, zeroed, 0)
        scale[rows] = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        qweight[rows] = torch.round(w / scale[rows, None]).clamp_(-127, 127)
    return qweight, scale


def int8_rows_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float, each row quantized with its own absmax scale, times int8 qweight [N, K] -> [M, N] fp32."""
    x = x.float()
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # [M, 1]
    xq = torch.round(x / row_scale).clamp_(-127, 127).to(torch.int8)  # as layer_ops.c: never -128
    return torch._int_mm(xq, qweight.t()).float().mul_(row_scale).mul_(scale)  # [M, N]


class QuantizedLinear(nn.Module):
    """What int8 and int4 linear layers share: the shape, the float outlier channels, and a shell that
    prepared_weights.load fills with the buffers it mapped (BUFFERS)."""

    BUFFERS: tuple[str, ...] = ()

    def _keep_outliers(self, linear: nn.Linear, outliers: torch.Tensor | None) -> torch.Tensor:
        """Set the shape and the outlier channels (None where there are none); returns the float weight."""
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if outliers is not None and len(outliers):
            outliers = outliers.to(weight.device, torch.long).sort().values
            self.register_buffer("outliers", outliers, persistent=False)
            # [count, N]: a row per channel, so the C loops run along the output columns (outlier_columns.h)
            rows = weight[:, outliers].t().to(OUTLIER_WEIGHT_DTYPE).contiguous()
            self.register_buffer("outlier_weight", rows, persistent=False)
        else:
            self.outliers = self.outlier_weight = None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        return weight

    @classmethod
    def shell(cls, linear: nn.Linear):
        """A layer of linear's shape with no weights yet: prepared_weights.load puts in those it mapped."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        for name in ("outliers", "outlier_weight", "bias", *cls.BUFFERS):
            self.register_buffer(name, None, persistent=False)
        return self


class Int8Linear(QuantizedLinear):
    BUFFERS = ("qweight", "qweight_sums", "scale")

    def __init__(self, linear: nn.Linear, outliers: torch.Tensor | None = None):
        """outliers: input channels kept in float (CPU), or None."""
        super().__init__()
        weight = self._keep_outliers(linear, outliers)
        qweight, scale = quantize_weight(weight, self.outliers)  # the outlier channels as zero
        self.register_buffer("qweight", qweight, persistent=False)  # [N, K] int8, or interleaved (interleave())
        self.register_buffer("qweight_sums", small_matmul.weight_sums(qweight), persistent=False)  # [N] int32
        self.register_buffer("scale", scale, persistent=False)  # [N] fp32

    def interleave(self) -> bool:
        """Keep qweight, in place of the plain one, in the layout the C product streams fastest where it takes every
        product of this layer (small_matmul.interleave), the outlier weights tiled with it. Returns whether it did.
        Only with layer_ops too: without it forward() takes PyTorch's path, which would copy the weight back."""
        takes_all = not small_matmul.is_interleaved(self.qweight) and layer_ops.handles()
        interleaved = small_matmul.interleave(self.qweight) if takes_all else None
        if interleaved is not None:
            self.qweight = interleaved
            if self.outlier_weight is not None:
                self.outlier_weight = small_matmul.tile_outliers(self.outlier_weight)
        return interleaved is not None

    def plain_qweight(self) -> torch.Tensor:
        """qweight as [N, K] for PyTorch's ops (a copy where interleaved and the C product was unloaded since)."""
        return small_matmul.plain(self.qweight)

    def plain_outlier_weight(self) -> torch.Tensor | None:
        """outlier_weight as [count, N] (or None), as plain_qweight."""
        return small_matmul.plain_outliers(self.outlier_weight, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.outliers is None:
            from kvferry.kernels.triton.int8_matmul import int8_matmul

            return int8_matmul(x, self.qweight, self.scale, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if layer_ops.handles(x2, self.scale):  # the CPU's, so the outlier indices are on the CPU too
            # In C passes, not a dozen ops: at decode sizes the ops' dispatch costs more than their work.
            xq, row_scale, x_out = layer_ops.quantize_rows(x2, self.outliers)
            # A few rows, or any number where torch._int_mm is a scalar loop: the same output, in one C pass
            if small_matmul.handles(xq, self.qweight):
                outliers = None if self.outliers is None else (x_out, self.outlier_weight)
                y = small_matmul.matmul_i8(
                    xq, self.qweight, self.qweight_sums, row_scale, self.scale, outliers, self.bias
                )
            else:
                y = layer_ops.dequantize(torch._int_mm(xq, self.plain_qweight().t()), row_scale, self.scale)
                layer_ops.add_outlier_columns(y, x_out, self.plain_outlier_weight(), self.bias)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        if self.outliers is None:
            y = int8_rows_matmul(x2, self.plain_qweight(), self.scale)
        else:
            y = int8_rows_matmul(x2.index_fill(1, self.outliers, 0.0), self.plain_qweight(), self.scale)
            y.addmm_(x2[:, self.outliers], self.plain_outlier_weight().float())
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)


def interleave_linears(model: nn.Module) -> int:
    """Every Int8Linear.interleave(), once the C kernels are loaded; returns how many moved."""
    return sum(m.interleave() for m in model.modules() if isinstance(m, Int8Linear))


def quantize_linears(model: nn.Module, outliers: dict[str, torch.Tensor] | None = None) -> int:
    """Swap every nn.Linear for an Int8Linear (outliers: its float channels, by module name); returns how many. A
    tied lm_head gets its own int8 copy: the embedding table keeps its float rows for the lookup."""
    outliers = outliers or {}
    return swap_linears(model, lambda name, linear: Int8Linear(linear, outliers.get(name)))


def swap_linears(model: nn.Module, make) -> int:
    """Replace every nn.Linear in model by make(its module name, it); returns how many were replaced."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(f"{parent_name}.{name}" if parent_name else name, child))
                swapped += 1
    return swapped
