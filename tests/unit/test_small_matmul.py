"""The C int8 product (kernels/cpu/small_matmul.c): its sums equal torch._int_mm's bit for bit at every row count, and
int8 linear layers take it only where they should, with the same output as without it."""

from pathlib import Path

import pytest
import torch

from kvferry.common.model.int8_linear import Int8Linear
from kvferry.kernels.cpu import layer_ops, small_matmul


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("kernels")
    assert small_matmul.enable(build_dir) == "" and layer_ops.enable(build_dir) == ""
    yield
    small_matmul.disable()
    layer_ops.disable()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 70])  # a few; more, in groups of four and a tail
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


def test_a_few_contiguous_int8_rows_are_taken_and_more_only_where_torch_int_mm_is_slow(kernels):
    q = torch.zeros(8, 32, dtype=torch.int8)
    assert small_matmul.handles(torch.zeros(small_matmul.MAX_ROWS, 32, dtype=torch.int8), q)
    flags = Path("/proc/cpuinfo").read_text().split()  # the compiler's -march=native sees the same flags
    every_row_count = "avx2" in flags and "avx512_vnni" not in flags  # where torch._int_mm is a scalar loop
    more = torch.zeros(small_matmul.MAX_ROWS + 1, 32, dtype=torch.int8)
    assert small_matmul.handles(more, q) == every_row_count
    assert not small_matmul.handles(torch.zeros(32, 2, dtype=torch.int8).t(), q)  # not contiguous
    assert not small_matmul.handles(torch.zeros(1, 32), q.float())


def _without_small_matmul(layer, x, build_dir):
    small_matmul.disable()
    try:
        return layer(x)
    finally:
        assert small_matmul.enable(build_dir) == ""


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 40])
def test_an_int8_layer_gives_the_int_mm_paths_output_at_any_row_count(kernels, tmp_path_factory, rows):
    generator = torch.Generator().manual_seed(rows)
    layer = Int8Linear(torch.nn.Linear(128, 72), outliers=torch.tensor([3, 70]))
    x = torch.randn(rows, 128, generator=generator)
    x[:, 3] *= 40  # a loud channel, kept in float
    with torch.no_grad():
        assert torch.equal(layer(x), _without_small_matmul(layer, x, tmp_path_factory.mktemp("k")))
