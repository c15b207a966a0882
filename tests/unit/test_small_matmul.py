"""The C products for a few rows (kernels/cpu/small_matmul.c): int8 equals torch._int_mm bit for bit, fp32 matches
PyTorch's matmul to rounding, and the linear layers take them only where they should."""

import pytest
import torch

from kvferry.common.model.cpu_linear import PackedLinear
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.kernels.cpu import layer_ops, small_matmul


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("kernels")
    assert small_matmul.enable(build_dir) == "" and layer_ops.enable(build_dir) == ""
    yield
    small_matmul.disable()
    layer_ops.disable()


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, n", [(576, 203), (1536, 64), (100, 9), (64, 1)])  # vector widths, odd widths, tails
def test_int8_sums_are_torch_int_mm_bit_for_bit(kernels, rows, k, n):
    generator = torch.Generator().manual_seed(rows * k + n)
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    x[0], w[0] = -127, -127  # the largest sum a row can have, and one with the flipped sign bit everywhere
    row_scale, col_scale = torch.rand(rows, generator=generator), torch.rand(n, generator=generator)
    expected = torch._int_mm(x, w.t()).float() * row_scale[:, None] * col_scale
    got = small_matmul.matmul_i8(x, w, small_matmul.weight_sums(w), row_scale, col_scale)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, n", [(576, 3072), (1536, 7), (35, 130)])
def test_fp32_matches_pytorchs_matmul(kernels, rows, k, n):
    generator = torch.Generator().manual_seed(rows + k + n)
    x, w = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)
    torch.testing.assert_close(small_matmul.matmul_f32(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)


def test_only_a_few_contiguous_rows_of_matching_dtypes_are_taken(kernels):
    w, q = torch.randn(8, 32), torch.zeros(8, 32, dtype=torch.int8)
    assert small_matmul.handles(torch.randn(small_matmul.MAX_ROWS[torch.float32], 32), w)
    assert not small_matmul.handles(torch.randn(small_matmul.MAX_ROWS[torch.float32] + 1, 32), w)
    assert small_matmul.handles(torch.zeros(small_matmul.MAX_ROWS[torch.int8], 32, dtype=torch.int8), q)
    assert not small_matmul.handles(torch.zeros(small_matmul.MAX_ROWS[torch.int8] + 1, 32, dtype=torch.int8), q)
    assert not small_matmul.handles(torch.randn(32, 1).t(), w.t().contiguous().t())  # not contiguous
    assert not small_matmul.handles(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16())
    assert not small_matmul.handles(torch.zeros(1, 32, dtype=torch.int8), w)


def _without_small_matmul(layer, x, build_dir):
    small_matmul.disable()
    try:
        return layer(x)
    finally:
        assert small_matmul.enable(build_dir) == ""


@pytest.mark.parametrize("rows", [1, 3, 4, 5])
def test_an_int8_layer_gives_the_int_mm_paths_output_at_any_row_count(kernels, tmp_path_factory, rows):
    generator = torch.Generator().manual_seed(rows)
    layer = Int8Linear(torch.nn.Linear(128, 72), outliers=torch.tensor([3, 70]))
    x = torch.randn(rows, 128, generator=generator)
    x[:, 3] *= 40  # a loud channel, kept in float
    with torch.no_grad():
        assert torch.equal(layer(x), _without_small_matmul(layer, x, tmp_path_factory.mktemp("k")))


def test_a_packed_fp32_layer_takes_the_c_product_at_one_row_and_keeps_onednns_beyond(kernels, tmp_path_factory):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not in this PyTorch build")
    linear = torch.nn.Linear(576, 300, bias=False).requires_grad_(False)
    layer = PackedLinear(linear)
    assert layer.weight.data_ptr() == linear.weight.data_ptr()  # the plain weight is kept, not copied
    for rows in (1, 2, 3, 32):
        x = torch.randn(rows, 576)
        got, onednn = layer(x), _without_small_matmul(layer, x, tmp_path_factory.mktemp("k"))
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-4)
        # Past the C product's rows, the same oneDNN call gives the same bits.
        assert torch.equal(got, onednn) == (rows > small_matmul.MAX_ROWS[torch.float32])
