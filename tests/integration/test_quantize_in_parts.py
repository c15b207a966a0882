"""Quantizing a model a decoder layer at a time (common/model/quantize.py's quantize_in_parts, loader.load_in_parts)
gives the same weights as quantizing the whole float model: each layer's calibration sees the same float
activations. A checkpoint missing a weight is still an error."""

import pytest
import torch

from kvferry.common.errors import ModelLoadError
from kvferry.common.model.loader import load_in_parts, load_model
from kvferry.common.model.quantize import quantize_in_parts, quantize_model
from tests.tiny_models import save_tiny_model

CALIBRATION = list(range(3, 300, 3))


def _tensors(model) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: t for name, t in named if t is not None}


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "mistral"])  # a tied head with biases; an untied one
def test_a_layer_at_a_time_gives_the_whole_models_weights(tmp_path, kind, arch):
    save_tiny_model(arch, tmp_path)
    cpu = torch.device("cpu")
    whole, _, _ = load_model(tmp_path, torch.float32, cpu)
    assert quantize_model(whole, cpu, CALIBRATION, kind) == 4 * len(whole.layers) + 1
    parts, _, _ = load_model(tmp_path, torch.float32, cpu, read_weights=False)
    outer, load_layer, check = load_in_parts(tmp_path, parts)
    assert quantize_in_parts(parts, CALIBRATION, kind, outer, load_layer) == 4 * len(parts.layers) + 1
    check()
    expected, got = _tensors(whole), _tensors(parts)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(
    "missing, message",
    [
        ("model.layers.1.mlp.up_proj.weight", "incomplete fused weight"),  # found while layer 1 loads
        ("model.layers.1.post_attention_layernorm.weight", "weights missing from the checkpoint: layers.1.post"),
    ],
)
def test_a_weight_missing_from_the_checkpoint_is_named(tmp_path, missing, message):
    from safetensors.torch import load_file, save_file

    save_tiny_model("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights[missing]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = load_model(tmp_path, torch.float32, torch.device("cpu"), read_weights=False)
    outer, load_layer, check = load_in_parts(tmp_path, model)
    with pytest.raises(ModelLoadError, match=message):
        quantize_in_parts(model, CALIBRATION, "int8", outer, load_layer)
        check()
