"""4-bit weights (common/model/int4_linear.py, kernels/cpu/int4_matmul.c): GGUF's Q4_1 numbers, made by its rule and
read from Q4_0 and Q4_1 blocks exactly; the C product equals the exact product of what it is given up to float
rounding, does not depend on the batch or the thread count, and the layer takes it where it should."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from kvferry.common.engine_setup import check_quantization
from kvferry.common.errors import ConfigError
from kvferry.common.model import int4_linear
from kvferry.common.model.int4_linear import Int4Linear
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.kernels.cpu import build, int4_matmul, layer_ops


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("kernels")
    assert int4_matmul.enable(build_dir) == "" and layer_ops.enable(build_dir) == ""
    yield build_dir
    int4_matmul.disable()
    layer_ops.disable()


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0  # a group with no range: scale 0
    w[-1, -32:] *= 50  # a loud group beside quiet ones
    return w


def test_a_checkpoint_is_quantized_by_q4_1s_rule_as_llama_cpp_does_it():
    w = _weights(6, 128, 0)
    q, scales, mins = int4_linear.quantize_weight(w)
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType.Q4_1)
    packed, their_scales, their_mins = int4_linear.from_gguf("Q4_1", theirs, (6, 128))
    assert torch.equal(scales, their_scales) and torch.equal(mins, their_mins)
    assert torch.equal(int4_linear.pack(q), packed)
    error = (int4_linear.dequantize(packed, scales, mins) - w).abs().reshape(6, 4, 32)
    assert (error <= scales.float()[:, :, None] / 2 + 1e-3 * w.abs().max()).all()  # half a step, and fp16's rounding


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_load_as_the_same_numbers(kind):
    w = _weights(5, 192, 1).numpy()
    blocks = quants.quantize(w, GGMLQuantizationType[kind])
    expected = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float32))
    packed, scales, mins = int4_linear.from_gguf(kind, blocks, (5, 192))
    assert packed.shape == (5, 96) and scales.shape == mins.shape == (5, 6)
    assert torch.equal(int4_linear.dequantize(packed, scales, mins), expected)


def test_packing_keeps_64_values_in_32_bytes_low_then_high():
    q = torch.randint(0, 16, (3, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = int4_linear.pack(q)
    assert packed.shape == (3, 64) and torch.equal(int4_linear.unpack(packed), q)
    assert packed[1, 5] == q[1, 5] | (q[1, 37] << 4) and packed[2, 40] == q[2, 72] | (q[2, 104] << 4)


def _exact(xq, packed, scales, mins, row_scale):
    weights = int4_linear.dequantize(packed, scales, mins).double()
    return (xq.double() @ weights.t()) * row_scale.double()


def _close(got, xq, packed, scales, mins, row_scale) -> bool:
    """Within float32's rounding of the exact product: relative to the sum of its terms' magnitudes."""
    magnitude = _exact(xq.abs(), packed, scales.abs(), mins.abs(), row_scale)  # every term counted positive
    return bool(((got.double() - _exact(xq, packed, scales, mins, row_scale)).abs() <= 1e-5 * magnitude + 1e-6).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 70])  # a few; more, in groups of four and a tail
@pytest.mark.parametrize("k, n", [(576, 203), (1536, 64), (64, 9), (2048, 1)])  # tails of rows, a lone row
def test_the_c_product_is_the_exact_product_up_to_float_rounding(kernels, rows, k, n):
    generator = torch.Generator().manual_seed(rows * k + n)
    xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
    xq[0] = 127
    q, scales, mins = int4_linear.quantize_weight(_weights(n, k, rows))
    packed, row_scale = int4_linear.pack(q), torch.rand(rows, 1, generator=generator)
    assert _close(int4_matmul.matmul_i4(xq, packed, scales, mins, row_scale), xq, packed, scales, mins, row_scale)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_does_not_depend_on_its_batch_or_the_threads(kernels, threads):
    generator = torch.Generator().manual_seed(3)
    xq = torch.randint(-127, 128, (9, 1024), dtype=torch.int8, generator=generator)
    q, scales, mins = int4_linear.quantize_weight(_weights(260, 1024, 3))
    packed, row_scale = int4_linear.pack(q), torch.rand(9, 1, generator=generator)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        batch = int4_matmul.matmul_i4(xq, packed, scales, mins, row_scale)
        torch.set_num_threads(1)
        alone = [int4_matmul.matmul_i4(xq[i : i + 1], packed, scales, mins, row_scale[i : i + 1]) for i in range(9)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, torch.cat(alone))


def test_the_avx2_build_gives_the_same_product_up_to_float_rounding(kernels):
    # Eight lanes and vpmaddubsw, as on a CPU without AVX-512; needs AVX2 itself, else both builds take the plain loop
    avx2 = build.Library(int4_matmul.SOURCE, int4_matmul.SIGNATURES, "-", (*int4_matmul.FLAGS, "-mno-avx512f"))
    assert avx2.enable(kernels / "avx2") == ""
    generator = torch.Generator().manual_seed(4)
    xq = torch.randint(-127, 128, (6, 576), dtype=torch.int8, generator=generator)
    q, scales, mins = int4_linear.quantize_weight(_weights(37, 576, 4))
    packed, row_scale = int4_linear.pack(q), torch.rand(6, 1, generator=generator)
    y = torch.empty(6, 37)
    avx2.kvferry_matmul_i4(
        xq.data_ptr(), 6, 576, packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), 37, row_scale.data_ptr(),
        None, None, 0, None, y.data_ptr(), 1,
    )  # fmt: skip
    assert _close(y, xq, packed, scales, mins, row_scale)


def _layer(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    return linear


@pytest.mark.parametrize("with_outliers", [False, True])
def test_the_layer_gives_the_pytorch_paths_output_where_the_c_product_is_not_loaded(kernels, with_outliers):
    linear = _layer(128, 48, True, 5)
    outliers = torch.tensor([3, 100]) if with_outliers else None
    layer = Int4Linear(linear, outliers)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(5))
    x[:, 3] *= 40  # a loud channel: in float where it is an outlier
    with_c = layer(x)
    int4_matmul.disable()
    try:
        without_c = layer(x)
    finally:
        assert int4_matmul.enable(kernels) == ""
    assert torch.allclose(with_c, without_c, rtol=1e-4, atol=1e-4)
    reference = linear(x)  # and close to the float layer: a 4-bit step is about 1/15 of a group's range
    assert (with_c - reference).abs().mean() < 0.1 * reference.abs().mean()


def test_the_head_and_layers_not_in_whole_64s_stay_int8():
    model = nn.Module()
    model.inner = nn.Linear(128, 64)
    model.narrow = nn.Linear(96, 64)
    model.lm_head = nn.Linear(128, 320, bias=False)
    assert int4_linear.quantize_linears(model) == 3
    assert isinstance(model.inner, Int4Linear)
    assert isinstance(model.narrow, Int8Linear) and isinstance(model.lm_head, Int8Linear)


def test_int4_is_refused_on_a_device_without_its_kernels():
    check_quantization("int4", torch.device("cpu"))
    check_quantization("int8", torch.device("cuda"))
    with pytest.raises(ConfigError, match="--quantization int4 is not served on cuda"):
        check_quantization("int4", torch.device("cuda"))
