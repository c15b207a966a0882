"""--quantization int4 of a GGUF model takes its Q4_0 / Q4_1 tensors as they are (common/model/gguf_int4.py): the
default model ships as Q4_1, so each of its 4-bit layers holds exactly the weights its float model computes with."""

import torch

from kvferry.common import model_files
from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.model.int4_linear import Int4Linear, dequantize
from kvferry.common.model.loader import load_model


def test_the_default_models_q4_1_weights_are_taken_as_they_are():
    model_dir = model_files.resolve_model(None)
    source = model_files.gguf_source(model_dir)  # this clone's file, or another's copy of it: the same content
    assert source is not None and model_files.converted_dir(source) == model_dir
    engine = LLMEngine(EngineConfig(quantization="int4", kv_cache_memory=2**24, num_threads=1))
    reference, _, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    layers = {name: m for name, m in engine.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 4 * len(reference.layers)  # qkv, o, gate_up, down of every layer
    for name, layer in layers.items():
        weight = reference.get_submodule(name).weight
        assert torch.equal(dequantize(layer.qweight, layer.scales, layer.mins), weight), name
