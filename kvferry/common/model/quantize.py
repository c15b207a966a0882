"""--quantization: a float model's linear layers swapped for quantized ones in place, int8 (int8_linear.py) or
int4 (int4_linear.py), after the outlier channels are calibrated on the CPU (quant_calibration.py).

quantize_model takes a whole float model. quantize_in_parts builds the quantized model from the checkpoint one
decoder layer at a time, the calibration text's forward running through each layer as soon as it is loaded: the
layer's linear layers are quantized right after it ran, and its float weights freed, so the float model is never
whole in memory (a 1.7B model is 6.4 GiB in fp32, against 1.5 GiB in int4).
"""

import torch
from torch import nn

from kvferry.common.model import int4_linear, int8_linear
from kvferry.common.model.quant_calibration import DenseCausalBatch, outlier_channels, record_peaks

QUANTIZATIONS = {"int8": int8_linear.quantize_linears, "int4": int4_linear.quantize_linears}


def quantize_model(model: nn.Module, device: torch.device, calibration_ids: list[int] | None, kind: str) -> int:
    """Quantize model's linear layers as kind says; returns how many moved."""
    outliers = None
    if device.type == "cpu":
        if not calibration_ids:
            raise ValueError(f"{kind} on the CPU calibrates its outlier channels on a text: calibration_ids is empty")
        outliers = outlier_channels(model, calibration_ids, int8_linear.NUM_OUTLIER_CHANNELS)
    return QUANTIZATIONS[kind](model, outliers)


@torch.inference_mode()
def quantize_in_parts(model: nn.Module, calibration_ids: list[int], kind: str, outer, load_layer) -> int:
    """model: built without its weights; outer() loads the weights outside the decoder layers, load_layer(i) layer
    i's (loader.load_in_parts). Calibrates and quantizes as quantize_model on the CPU, a layer at a time; returns
    how many layers moved."""
    if not calibration_ids:
        raise ValueError(f"{kind} on the CPU calibrates its outlier channels on a text: calibration_ids is empty")
    quantize = QUANTIZATIONS[kind]
    moved = 0
    with record_peaks(model) as peaks:

        def outliers(prefix: str) -> dict[str, torch.Tensor]:
            count = int8_linear.NUM_OUTLIER_CHANNELS
            return {name.removeprefix(prefix): p.topk(min(count, p.numel())).indices for name, p in peaks.items()
                    if name.startswith(prefix)}  # fmt: skip

        def after_layer(i: int) -> None:
            nonlocal moved
            moved += quantize(model.layers[i], outliers(f"layers.{i}."))  # its float weights go with the modules
            if i + 1 < len(model.layers):
                load_layer(i + 1)

        outer()
        load_layer(0)
        ids = torch.tensor(calibration_ids[: model.rope_cos.shape[0]])
        hidden = model(ids, torch.arange(len(ids)), DenseCausalBatch(), after_layer=after_layer)
        for rows in hidden.split(128):  # the lm_head's input too, a slice at a time: the logits are wide
            model.compute_logits(rows)
    return moved + quantize(model, outliers(""))  # what is left: the lm_head
