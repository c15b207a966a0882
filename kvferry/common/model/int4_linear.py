"""4-bit weights (`--quantization int4`): each linear layer's weights in groups of 32 along the input, each group
32 four-bit values q and a half-precision scale and minimum, value = q * scale + min: the numbers of GGUF's Q4_1.
5 bits a weight.

Why this: the 4-bit GGUF files users have are Q4_0 and Q4_1 (the default model ships as Q4_1), and both load into
it exactly (from_gguf: Q4_0's (q - 8) * scale is min = -8 * scale, exact in half precision), with no second
rounding. A checkpoint quantized here gets the numbers llama.cpp's llama-quantize gives Q4_1 (the same rule): the
minimum follows a group's range, which Q4_0's symmetric one cannot, for half a bit more than Q4_0. Groups of 32
keep each scale close to its weights with no calibration data, where AWQ's or GPTQ's groups of 128 need it. Its error
is larger than int8's: `kvferry bench quantization --quantization int4` measures it.

As int8 on the CPU: activations are quantized per row to int8 and the products summed in int32 (int4_matmul.c),
with the calibrated outlier channels kept in float (int8_linear.py says why). The lm_head stays int8, as llama.cpp
keeps its output layer at 6 bits or more: every token's choice goes through it. A layer whose input width is not a
multiple of 64 (the packing unit) stays int8 too.
"""

import warnings

import torch
from torch import nn

from kvferry.common.model.int8_linear import QUANTIZE_ROWS, Int8Linear, QuantizedLinear, swap_linears
from kvferry.kernels.cpu import int4_matmul, layer_ops

GROUP, CHUNK = int4_matmul.GROUP, int4_matmul.CHUNK


def quantize_weight(
    weight: torch.Tensor, zeroed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] uint8 in [0, 15], fp16 scales and mins [N, K / 32]) by Q4_1's rule: a group's
    minimum and its range over 15 steps, kept in fp16, the values rounded with the fp32 ones; the input channels
    `zeroed` (or none) taken as zero. QUANTIZE_ROWS rows at a time, as int8's quantize_weight."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scales, mins = torch.empty(n, k // GROUP, dtype=torch.float16), torch.empty(n, k // GROUP, dtype=torch.float16)
    for first in range(0, n, QUANTIZE_ROWS):
        rows = slice(first, first + QUANTIZE_ROWS)
        w = weight[rows].detach().float()
        if zeroed is not None:
            w = w.index_fill(1, zeroed, 0)
        w = w.reshape(-1, k // GROUP, GROUP)
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        scale = (high - low) / 15.0
        inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
        q[rows] = torch.floor((w - low) * inverse + 0.5).clamp_(0, 15).reshape(-1, k)
        scales[rows], mins[rows] = scale[:, :, 0].half(), low[:, :, 0].half()
    return q, scales, mins


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in [0, 15] -> [N, K / 2]: in each 64 values' 32 bytes, byte i holds value i (low) and value
    i + 32 (high), int4_matmul.c's order."""
    n, k = q.shape
    halves = q.reshape(n, k // CHUNK, 2, CHUNK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: [N, K / 2] -> q [N, K] uint8."""
    n, half = packed.shape
    chunks = packed.reshape(n, half // (CHUNK // 2), 1, CHUNK // 2)
    return torch.cat([chunks & 15, chunks >> 4], dim=2).reshape(n, 2 * half)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The weights the 4-bit layer stands for, fp32 [N, K]."""
    q = unpack(packed).float()
    n, k = q.shape
    grouped = q.reshape(n, k // GROUP, GROUP) * scales.float()[:, :, None] + mins.float()[:, :, None]
    return grouped.reshape(n, k)


GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # per 32 values: the fp16 scale (and Q4_1's fp16 min), 16 bytes of q


def from_gguf(kind: str, blocks, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 or Q4_1 tensor's raw blocks (uint8; byte i of a block's 16 holds value i low and value i + 16
    high) of logical shape [N, K] -> (packed, scales, mins) as this module keeps them, the same numbers exactly."""
    n, k = shape
    with warnings.catch_warnings():  # a GGUF file's mapping is read-only, and only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        raw = torch.as_tensor(blocks).reshape(n, k // GROUP, GGUF_BLOCK_BYTES[kind])
    halves = raw[:, :, : GGUF_BLOCK_BYTES[kind] - 16].contiguous().view(torch.float16)  # [N, G, 1 or 2]
    scales = halves[:, :, 0].contiguous()
    mins = halves[:, :, 1].contiguous() if kind == "Q4_1" else scales * -8.0  # a power of two: exact
    nibbles = raw[:, :, -16:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).reshape(n, k)
    return pack(q), scales, mins


def fits(linear: nn.Linear) -> bool:
    """Whether a layer can be 4-bit: its input width in whole packing units."""
    return linear.in_features % CHUNK == 0


class Int4Linear(QuantizedLinear):
    BUFFERS = ("qweight", "scales", "mins")

    def __init__(self, linear: nn.Linear, outliers: torch.Tensor | None = None):
        """outliers: input channels kept in float (CPU), or None."""
        super().__init__()
        weight = self._keep_outliers(linear, outliers)
        q, scales, mins = quantize_weight(weight, self.outliers)  # as zero: the groups' scales fit the others
        self.register_buffer("qweight", pack(q), persistent=False)  # [N, K / 2] uint8
        self.register_buffer("scales", scales, persistent=False)  # [N, K / 32] fp16
        self.register_buffer("mins", mins, persistent=False)  # [N, K / 32] fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if layer_ops.handles(x2) and x2.shape[0] > 0:
            xq, row_scale, x_out = layer_ops.quantize_rows(x2, self.outliers)
            if int4_matmul.handles(xq, self.qweight):
                outliers = None if self.outliers is None else (x_out, self.outlier_weight)
                y = int4_matmul.matmul_i4(xq, self.qweight, self.scales, self.mins, row_scale, outliers, self.bias)
                return y.to(x.dtype).reshape(*lead, self.out_features)
        # Without the C product (or on another device): the same quantized rows times the dequantized weights
        weight = dequantize(self.qweight, self.scales, self.mins).to(x2.device)
        if self.outliers is not None:
            kept = x2.index_fill(1, self.outliers, 0.0)
        else:
            kept = x2
        row_scale = kept.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)
        xq = torch.round(kept / row_scale).clamp_(-127, 127)
        y = (xq @ weight.t()).mul_(row_scale)
        if self.outliers is not None:
            y.addmm_(x2[:, self.outliers], self.outlier_weight.float())
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)


def quantize_linears(model: nn.Module, outliers: dict[str, torch.Tensor] | None = None) -> int:
    """Swap every nn.Linear for an Int4Linear, the lm_head and any layer fits() refuses for an Int8Linear (outliers:
    their float channels, by module name); returns how many."""
    outliers = outliers or {}

    def make(name: str, linear: nn.Linear) -> nn.Module:
        kind = Int4Linear if name != "lm_head" and fits(linear) else Int8Linear
        return kind(linear, outliers.get(name))

    return swap_linears(model, make)
