"""Int8 weights: the quantizer, the CPU product with float outlier channels, the Triton kernel (compiled on a GPU,
interpreted elsewhere), calibration, and the setting."""

import pytest
import torch
from torch import nn

from kvferry.common.config import EngineConfig
from kvferry.common.errors import ConfigError
from kvferry.common.model.int8_linear import (
    OUTLIER_WEIGHT_DTYPE,
    Int8Linear,
    int8_rows_matmul,
    quantize_linears,
    quantize_weight,
)
from kvferry.kernels.triton.int8_matmul import int8_matmul
from tests.kernel_dtypes import DEVICE, DTYPES, rounding_tolerance


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
    with torch.random.fork_rng():  # the layer's weights too, not whatever state earlier tests left
        torch.manual_seed(2)
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
    # Only the outliers' columns are left out of the int8 weights, and they are kept in half precision.
    assert split.qweight[:, [5, 60]].eq(0).all()
    assert torch.equal(split.outlier_weight, linear.weight[:, [5, 60]].t().to(OUTLIER_WEIGHT_DTYPE))


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


def matmul_tolerance(dtype, x, w, b, k):
    """int8 weights widen to any of these dtypes exactly, and the products are exact in fp32. What is left: the
    output's rounding to dtype (half an eps of its size, at most |x|.|w| + |b|), and fp32 sums over k terms, in the
    kernel and in the reference, whose rounding grows like the square root of k."""
    bound = (x.abs() @ w.abs().T + (b.abs() if b is not None else 0)).max().item()
    return rounding_tolerance(bound, dtype, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n,bias", [(1, 64, 48, False), (5, 100, 70, True), (33, 40, 130, True)])
def test_triton_int8_matmul_matches_the_dequantized_product(m, k, n, bias, dtype):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    q, scale = quantize_weight(w)
    w_float, b_float = dequantized(q, scale), (b.float() if bias else None)
    expected = x.float() @ w_float.T + (b_float if bias else 0)  # the fp32 reference of the same inputs
    tolerance = matmul_tolerance(dtype, x.float(), w_float, b_float, k)
    x, q, scale, b, expected = (t.to(DEVICE) if t is not None else None for t in (x, q, scale, b, expected))
    out = int8_matmul(x, q, scale, b)
    assert out.dtype == dtype  # activations come back in their own dtype
    assert (out.float() - expected).abs().max().item() <= tolerance
    assert torch.equal(int8_matmul(x.reshape(1, m, k), q, scale, b), out[None])  # leading dims are flattened


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
    assert EngineConfig(quantization="int4").quantization == "int4"
    with pytest.raises(ConfigError, match="quantization must be int8, int4 or none"):
        EngineConfig(quantization="int2")
