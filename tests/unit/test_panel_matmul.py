"""The C fp32 product over oneDNN's packed panels (kernels/cpu/panel_matmul.c): the panels' width is read off the
packed memory, the product equals the float64 product within fp32's rounding, a row's output is the same bit for bit
at every row count, and packed linear layers take it up to its max_rows."""

import pytest
import torch

from kvferry.common.model.cpu_linear import DECODE_BATCH_HINT, PackedLinear, can_pack, panel_width_of
from kvferry.kernels.cpu import panel_matmul

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch has no oneDNN")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    assert panel_matmul.enable(tmp_path_factory.mktemp("kernels")) == ""
    yield
    panel_matmul.disable()


def _packed(n, k, bias, seed):
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    packed = PackedLinear(linear)
    if packed.panel_width is None or not panel_matmul.handles(torch.zeros(1, k), packed.panel_width):
        pytest.skip(f"oneDNN packs a [{n}, {k}] weight in a layout other than panels the kernel takes here")
    return linear, packed


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 33])  # past four, blocks of six rows and what is left
@pytest.mark.parametrize("n, k, bias", [(1536, 576, False), (576, 1536, True), (192, 576, True), (72, 128, False)])
def test_the_panel_product_is_the_float64_product_within_rounding(kernel, rows, n, k, bias):
    # SmolLM2's shapes, a narrow weight (oneDNN packs it in narrower panels) and one padded past its last column
    if rows > panel_matmul.max_rows():
        pytest.skip(f"the product takes {panel_matmul.max_rows()} rows on this CPU")
    linear, packed = _packed(n, k, bias, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        got = packed(x)
        want = x.double() @ linear.weight.double().t() + (0 if linear.bias is None else linear.bias.double())
    bound = k * 2**-23 * (x.abs().double() @ linear.weight.abs().double().t()) + 1e-6
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("n, k, bias", [(1536, 576, True), (192, 576, False), (72, 128, True)])
def test_a_rows_output_is_the_same_bit_for_bit_at_every_row_count(kernel, n, k, bias):
    # Sums in order of k at any row count: a request's output does not depend on the batch it decodes in
    linear, packed = _packed(n, k, bias, seed=k)
    x = torch.randn(min(33, panel_matmul.max_rows()), k, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(len(x))])
        for rows in sorted({1, 4, 5, 6, 7, 12, 13, len(x)}):
            if rows <= len(x):
                assert torch.equal(packed(x[:rows]), alone[:rows]), rows


def test_packed_layers_take_it_up_to_its_max_rows(kernel, monkeypatch):
    linear, packed = _packed(1536, 576, True, seed=1)
    calls = []
    real = panel_matmul.matmul
    monkeypatch.setattr(panel_matmul, "matmul", lambda x, *rest: calls.append(x.shape[0]) or real(x, *rest))
    most = panel_matmul.max_rows()
    assert most >= panel_matmul.MAX_ROWS
    with torch.no_grad():
        for rows in (1, panel_matmul.MAX_ROWS, most, most + 1):
            x = torch.randn(2, rows, 576)[0]  # a view: its rows are contiguous, so the C path may take it
            assert torch.allclose(packed(x), linear(x), rtol=1e-4, atol=1e-4)
    assert calls == [1, panel_matmul.MAX_ROWS, most]  # past its max_rows, oneDNN


def test_packed_memory_is_taken_as_panels_only_when_it_holds_the_weight():
    weight = torch.randn(1536, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_BATCH_HINT)
    width = panel_width_of(packed, weight)
    if width is None:
        pytest.skip("oneDNN's layout here is not panels")
    other = weight.clone()
    other[1000, 300] += 1  # one value off, in a later panel than the first
    assert panel_width_of(packed, other) is None
    assert panel_width_of(packed, weight[:, :575].contiguous()) is None  # another shape


def test_a_layer_packed_under_another_thread_count_reads_its_own_layout(kernel):
    # oneDNN packs a [192, 576] weight in 16-column panels with two threads here and in 64-column ones with one: a
    # layout found under one count must not be read into a weight packed under the other
    linear = torch.nn.Linear(576, 192)
    x = torch.randn(1, 576)
    threads = torch.get_num_threads()
    try:
        for count in (2, 1, 2):
            torch.set_num_threads(count)
            packed = PackedLinear(linear)
            if packed.panel_width is None:
                pytest.skip("oneDNN's layout here is not panels")
            calls = []
            real = panel_matmul.matmul
            panel_matmul.matmul = lambda x, *rest: calls.append(1) or real(x, *rest)
            try:
                with torch.no_grad():
                    assert torch.allclose(packed(x), linear(x), rtol=1e-4, atol=1e-4), count
            finally:
                panel_matmul.matmul = real
            assert calls == [1], count  # the C product ran, not oneDNN
    finally:
        torch.set_num_threads(threads)
