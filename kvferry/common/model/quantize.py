"""--quantization: a float model's linear layers swapped for quantized ones in place, int8 (int8_linear.py) or
int4 (int4_linear.py), after the outlier channels are calibrated on the CPU (quant_calibration.py)."""

import torch
from torch import nn

from kvferry.common.model import int4_linear, int8_linear
from kvferry.common.model.quant_calibration import outlier_channels

QUANTIZATIONS = {"int8": int8_linear.quantize_linears, "int4": int4_linear.quantize_linears}


def quantize_model(model: nn.Module, device: torch.device, calibration_ids: list[int] | None, kind: str) -> int:
    """Quantize model's linear layers as kind says; returns how many moved."""
    outliers = None
    if device.type == "cpu":
        if not calibration_ids:
            raise ValueError(f"{kind} on the CPU calibrates its outlier channels on a text: calibration_ids is empty")
        outliers = outlier_channels(model, calibration_ids, int8_linear.NUM_OUTLIER_CHANNELS)
    return QUANTIZATIONS[kind](model, outliers)
