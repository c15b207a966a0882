"""A model is built in its dtype, not built in fp32 and cast: the weights and RoPE tables come out the same as the
cast model's, in fp32 exactly as before, and int8 still quantizes from them."""

import pytest
import torch

from kvferry.common.model.int8_linear import Int8Linear, quantize_linears
from kvferry.common.model.loader import load_model
from tests.tiny_models import save_tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_built_in_bf16_equals_the_fp32_model_cast(tmp_path, arch):
    save_tiny_model(arch, tmp_path)
    cpu = torch.device("cpu")
    fp32, _, _ = load_model(tmp_path, torch.float32, cpu)
    bf16, _, _ = load_model(tmp_path, torch.bfloat16, cpu)
    assert torch.get_default_dtype() == torch.float32  # the build's default dtype does not leak out
    want = {name: tensor.to(torch.bfloat16) for name, tensor in fp32.state_dict().items()}  # what the cast gave
    got = bf16.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, want[name]), name
    for name in ("rope_cos", "rope_sin"):
        assert getattr(bf16, name).dtype == torch.bfloat16
        assert torch.equal(getattr(bf16, name), getattr(fp32, name).to(torch.bfloat16))
    assert fp32.rope_cos.dtype == torch.float32
    if arch == "qwen2":
        assert bf16.lm_head.weight is bf16.embed_tokens.weight  # still tied


def test_int8_quantizes_a_bf16_build(tmp_path):
    save_tiny_model("llama", tmp_path)
    model, _, _ = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert quantize_linears(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    head = model.lm_head
    assert isinstance(head, Int8Linear) and head.qweight.dtype == torch.int8
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    assert model.compute_logits(hidden).dtype == torch.bfloat16
