"""Int8 weights: the quantizer, the CPU product with float outlier channels, the Triton kernel (interpreter),
calibration, and the setting."""

import pytest
import torch
from torch import nn

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.model.int8_linear import Int8Linear, int8_rows_matmul, quantize_linears, quantize_weight
from kvferry.kernels.triton.int8_matmul import int8_matmul


def dequantized(qweight, scale):
    return qweight.float() * scale[:, None]


def test_quantize_weight_rounds_each_row_to_its_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (48,)
    assert ((dequantized(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(quantize_weight(torch.zeros(3, 5))[0], torch.zeros(3, 5, dtype=torch.int8))


def test_int8_rows_matmul_is_the_product_of_the_quantized_rows():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 64, generator=g), torch.randn(24, 64, generator=g)
    q, scale = quantize_weight(w)
    row_scale = x.abs().amax(1, keepdim=True) / 127
    x_rounded = torch.round(x / row_scale) * row_scale
    expected = x_rounded @ dequantized(q, scale).T
    torch.testing.assert_close(int8_rows_matmul(x, q, scale), expected, rtol=1e-5, atol=1e-5)
    exact = x @ w.T
    assert (int8_rows_matmul(x, q, scale) - exact).abs().max() < 0.05 * exact.abs().max()


def test_a_loud_row_costs_its_neighbours_no_precision():
    """Each row has its own scale: a row gets the same result alone or beside a row 100 times louder (exactly so in
    int8, where the sums are integers; to float rounding where the outlier channels' float matmul is added)."""
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 32)
    x = torch.randn(9, 64, generator=g)
    x[4] *= 100
    plain, split = Int8Linear(linear), Int8Linear(linear, outliers=torch.tensor([3, 17]))
    plain_batched, split_batched = plain(x), split(x)
    for i in range(9):
        assert torch.equal(plain(x[i : i + 1])[0], plain_batched[i])
        torch.testing.assert_close(split(x[i : i + 1])[0], split_batched[i], rtol=1e-6, atol=1e-6)


def test_outlier_channels_stay_in_float():
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(96, 40, bias=True)
    x = torch.randn(16, 96, generator=g)
    x[:, [5, 60]] *= 80  # two channels far above the rest, as in SmolLM2's hidden states
    exact = linear(x)
    plain, split = Int8Linear(linear), Int8Linear(linear, outliers=torch.tensor([60, 5]))
    plain_err, split_err = (plain(x) - exact).abs().mean(), (split(x) - exact).abs().mean()
    assert split_err < plain_err / 5, (split_err, plain_err)
    # Only the outliers' columns are left out of the int8 weights, and they are kept whole.
    assert split.qweight[:, [5, 60]].eq(0).all() and torch.equal(split.outlier_weight, linear.weight[:, [5, 60]])


def test_quantize_linears_swaps_every_linear_and_keeps_a_tied_embedding_in_float():
    emb = nn.Embedding(50, 16)
    model = nn.ModuleDict(
        {
            "emb": emb,
            "a": nn.Linear(16, 8),
            "inner": nn.ModuleDict({"b": nn.Linear(8, 16)}),
            "head": nn.Linear(16, 50, bias=False),
        }
    )
    model["head"].weight = emb.weight
    assert quantize_linears(model, {"inner.b": torch.tensor([1])}) == 3
    assert isinstance(model["a"], Int8Linear) and isinstance(model["head"], Int8Linear)
    assert model["inner"]["b"].outliers.tolist() == [1] and model["a"].outliers is None
    assert isinstance(model["emb"], nn.Embedding) and emb.weight.dtype == torch.float32  # the lookup stays float
    assert torch.equal(model["head"].qweight, quantize_weight(emb.weight)[0])  # the head: the tied rows, in int8


@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 48, False), (5, 100, 70, True), (33, 40, 130, True)])
def test_triton_int8_matmul_matches_the_dequantized_product(m, k, n, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q, scale = quantize_weight(w)
    expected = x @ dequantized(q, scale).T + (b if bias else 0)
    torch.testing.assert_close(int8_matmul(x, q, scale, b), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(int8_matmul(x.reshape(1, m, k), q, scale, b), expected[None], rtol=1e-4, atol=1e-4)
    # Half-precision activations (CUDA's dtypes) come back in their own dtype. fp16 only: the interpreter
    # mishandles bfloat16 even in a plain load and store, so bf16 can only be checked on a GPU.
    half = int8_matmul(x.half(), q, scale, None if b is None else b.half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), expected, rtol=2e-2, atol=2e-2)


def test_calibration_finds_a_planted_outlier_channel(tmp_path):
    from kvferry.common.model.loader import load_model
    from kvferry.common.model.quant_calibration import calibration_token_ids, outlier_channels
    from tests.tiny_models import VOCAB, save_tiny_model

    save_tiny_model("llama", tmp_path)
    model, _, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        model.layers[1].input_layernorm.weight[37] = 60.0  # feeds layer 1's q/k/v
        model.layers[0].mlp.gate_up_proj.weight[5] *= 40  # feeds layer 0's down_proj (through silu(gate) * up)
    ids = calibration_token_ids(None, VOCAB)
    assert len(ids) == 512 and ids == calibration_token_ids(None, VOCAB)  # the same in every process
    found = outlier_channels(model, ids, num_channels=4)
    assert 37 in found["layers.1.self_attn.qkv_proj"].tolist()
    assert 37 not in found["layers.0.self_attn.qkv_proj"].tolist()
    assert 5 in found["layers.0.mlp.down_proj"].tolist()
    assert set(found) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_the_quantization_setting():
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ConfigError, match="quantization must be int8 or none"):
        EngineConfig(quantization="int4")
