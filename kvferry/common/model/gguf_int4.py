"""A GGUF file's Q4_0 and Q4_1 weights taken into an int4 model as they are, not rounded a second time.

A GGUF model is served from the folder it was converted into (gguf_convert.py), whose weights are the GGUF's
de-quantized. `--quantization int4` quantizes that folder's model as any other (its outlier channels calibrated in
float first), then take_exact puts each Q4_0 or Q4_1 tensor's own numbers (int4_linear.from_gguf) into the rows of
its Int4Linear, in transformers' row order (llama.cpp permutes q and k for its RoPE) and at its place in the fused
q/k/v and gate/up weights. The converted folder names its GGUF file (model_files.GGUF_SOURCE, written when the
model is resolved); a folder without one, or whose file changed since, keeps the re-quantized numbers.
"""

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvferry.common.model.int4_linear import GGUF_BLOCK_BYTES, Int4Linear, from_gguf
from kvferry.common.model.llama import FUSED_PARTS
from kvferry.common.model_files import gguf_source

log = logging.getLogger("kvferry.engine")


def _rows(model: nn.Module, name: str) -> tuple[str, int] | None:
    """(the kvferry module a transformers weight name lands in, the first of its rows there), or None."""
    module = name.removeprefix("model.").removesuffix(".weight")
    if not name.endswith(".weight"):
        return None
    for part, (target, index) in FUSED_PARTS.items():
        if f".{part}" in module:
            module = module.replace(part, target)
            try:
                parent = model.get_submodule(module.rsplit(".", 1)[0])
            except AttributeError:  # not a weight of this model: the caller skips it
                return None
            if target == "qkv_proj":
                sizes = [parent.q_size, parent.kv_size, parent.kv_size]
            else:
                sizes = [parent.gate_up_proj.out_features // 2] * 2
            return module, sum(sizes[:index])
    return module, 0


@torch.inference_mode()  # as quantize_in_parts made the layers
def take_exact(model: nn.Module, model_dir: Path) -> int:
    """Put the Q4_0 and Q4_1 tensors of model_dir's GGUF source into model's Int4Linear layers; returns how many."""
    gguf_path = gguf_source(model_dir)
    if gguf_path is None:
        return 0
    from transformers import AutoConfig

    from kvferry.common.model.gguf_convert import logical_shape, plan

    planned, processor = plan(gguf_path, AutoConfig.from_pretrained(model_dir))
    taken = 0
    for tensor, name in planned:
        kind = tensor.tensor_type.name
        target = _rows(model, name) if kind in GGUF_BLOCK_BYTES else None
        if target is None:
            continue
        module_name, first = target
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            continue
        n, k = logical_shape(tensor)
        if not isinstance(layer, Int4Linear) or layer.in_features != k:
            continue
        packed, scales, mins = from_gguf(kind, np.asarray(tensor.data), (n, k))
        order = processor.process(weights=np.arange(n)[:, None], name=tensor.name).weights[:, 0]  # rows' order
        order = torch.from_numpy(np.ascontiguousarray(order))
        rows = slice(first, first + n)
        layer.qweight[rows], layer.scales[rows], layer.mins[rows] = packed[order], scales[order], mins[order]
        taken += 1
    log.info("int4: %d weights taken as they are from %s", taken, gguf_path.name)
    return taken
