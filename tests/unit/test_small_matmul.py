"""The C int8 product (kernels/cpu/small_matmul.c): its sums equal torch._int_mm's bit for bit at every row count, and
int8 linear layers take it only where they should, with the same output as without it."""

import copy
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


def _interleaved_or_skip(w):
    interleaved = small_matmul.interleave(w)
    if interleaved is None:
        assert not _every_row_count() or w.shape[0] % 4 or w.shape[1] % 32  # made wherever it should be
        pytest.skip("weights are interleaved only on AVX2 CPUs without VNNI, at n % 4 == 0 and k % 32 == 0")
    return interleaved


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 70])
@pytest.mark.parametrize("k, n", [(576, 204), (1536, 64), (64, 8)])
def test_interleaved_int8_sums_are_torch_int_mm_bit_for_bit(kernels, rows, k, n):
    """On every CPU: the C product reads the layout wherever it is handed one (where it is made, the AVX2 loop;
    elsewhere the plain loop's tail); interleave() makes it only where that loop takes every row count."""
    generator = torch.Generator().manual_seed(rows * k + n)
    x = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=generator)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    x[0], w[0], w[-1] = -127, -127, 127  # the largest sums, in the first and the last group
    interleaved = w.reshape(n // 4, 4, k // 32, 32).transpose(1, 2).contiguous()
    made = small_matmul.interleave(w)
    assert (made is not None) == _every_row_count()
    assert made is None or torch.equal(made, interleaved)
    assert torch.equal(small_matmul.plain(interleaved), w) and small_matmul.shape_of(interleaved) == (n, k)
    row_scale, col_scale = torch.rand(rows, generator=generator), torch.rand(n, generator=generator)
    expected = torch._int_mm(x, w.t()).float() * row_scale[:, None] * col_scale
    sums = small_matmul.weight_sums(interleaved)
    assert torch.equal(sums, small_matmul.weight_sums(w))
    assert torch.equal(small_matmul.matmul_i8(x, interleaved, sums, row_scale, col_scale), expected)


def test_weights_are_interleaved_only_at_shapes_the_loop_takes_whole(kernels):
    assert small_matmul.interleave(torch.zeros(6, 64, dtype=torch.int8)) is None  # rows not in groups of four
    assert small_matmul.interleave(torch.zeros(8, 48, dtype=torch.int8)) is None  # not in 32-byte pieces


def _every_row_count() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()  # the compiler's -march=native sees the same flags
    return "avx2" in flags and "avx512_vnni" not in flags  # where torch._int_mm is a scalar loop


def test_a_few_contiguous_int8_rows_are_taken_and_more_only_where_torch_int_mm_is_slow(kernels):
    q = torch.zeros(8, 32, dtype=torch.int8)
    assert small_matmul.handles(torch.zeros(small_matmul.MAX_ROWS, 32, dtype=torch.int8), q)
    every_row_count = _every_row_count()
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


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 40])
def test_an_int8_layer_gives_the_int_mm_paths_output_at_any_row_count(kernels, tmp_path_factory, rows, interleaved):
    generator = torch.Generator().manual_seed(rows)
    layer = Int8Linear(torch.nn.Linear(128, 72), outliers=torch.tensor([3, 70]))
    if interleaved:
        plain = layer.qweight
        _interleaved_or_skip(plain)
        assert layer.interleave() and layer.qweight.dim() == 4 and torch.equal(layer.plain_qweight(), plain)
        assert not layer.interleave()  # once
    x = torch.randn(rows, 128, generator=generator)
    x[:, 3] *= 40  # a loud channel, kept in float
    with torch.no_grad():
        assert torch.equal(layer(x), _without_small_matmul(layer, x, tmp_path_factory.mktemp("k")))


def test_outlier_weights_tile_and_come_back_whole():
    rows = torch.arange(3 * 40, dtype=torch.float16).reshape(3, 40)  # 40 columns: two tiles and a padded half
    tiled = small_matmul.tile_outliers(rows)
    assert tiled.shape == (3, 3, 16) and tiled.is_contiguous()
    assert torch.equal(tiled[1, 2], rows[2, 16:32]) and torch.equal(tiled[2, 0, :8], rows[0, 32:])
    assert (tiled[2, :, 8:] == 0).all()  # the padding
    back = small_matmul.plain_outliers(tiled, 40)
    assert torch.equal(back, rows) and back.is_contiguous()


@pytest.mark.parametrize("rows", [1, 2, 5, 40])
def test_an_interleaved_layer_split_between_threads_gives_the_plain_layers_output(kernels, rows):
    # Big enough for both threads, whose shares start at a tile of outlier columns; 600 columns, so the last tile is
    # padded. Interleaved with tiled outliers against the same layer plain, bit for bit.
    generator = torch.Generator().manual_seed(rows)
    layer = Int8Linear(torch.nn.Linear(576, 600), outliers=torch.tensor([0, 3, 100, 575]))
    plain = copy.deepcopy(layer)
    _interleaved_or_skip(layer.qweight)
    assert layer.interleave() and layer.outlier_weight.dim() == 3
    x = torch.randn(rows, 576, generator=generator)
    x[:, 3] *= 40
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            assert torch.equal(layer(x), plain(x))
    finally:
        torch.set_num_threads(before)
