"""The C kernels for the CPU against PyTorch: decode attention against the reference, the layer's elementwise functions
against PyTorch's ops; and how they are built, loaded and chosen."""

import pytest
import torch
import torch.nn.functional as F

from kvferry import kernels
from kvferry.common.model.int8_linear import Int8Linear
from kvferry.kernels import reference
from kvferry.kernels.cpu import build, layer_ops
from kvferry.kernels.cpu import decode_attention as cpu_decode
from kvferry.kernels.cpu import prefill_attention as cpu_prefill


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    assert cpu_decode.enable(tmp_path_factory.mktemp("kernels")) == ""
    yield
    cpu_decode.disable()


def _case(batch, heads, kv_heads, head_dim, block_size, lens, interleaved, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 4 + sum(-(-n // block_size) for n in lens)
    if interleaved:  # the runner's pool: a token's K and V side by side
        pool = torch.randn(num_blocks, block_size, 2, kv_heads, head_dim, generator=generator)
        k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
    else:
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    widest = max(-(-n // block_size) for n in lens)
    # Scattered, never shared, blocks; padding past a context points at block 0, which the kernel must not read.
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    tables, used = torch.zeros(batch, widest, dtype=torch.int32), 0
    for i, n in enumerate(lens):
        count = -(-n // block_size)
        tables[i, :count] = order[used : used + count]
        used += count
    query = torch.randn(batch, heads, head_dim, generator=generator)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size, lens, interleaved",
    [
        (9, 3, 64, 16, [1, 16, 17, 260, 33], True),  # SmolLM2's heads, contexts at and off block edges
        (4, 4, 32, 8, [5, 64, 1], False),  # no grouping, separate K and V tensors
        (8, 2, 128, 16, [300, 2, 129], True),  # a group of 4, a wide head
        (6, 1, 16, 1, [7, 1, 40], False),  # one KV head for all, one token per block
        (4, 2, 256, 16, [40, 3], False),  # the widest head taken: the most vectors a head can hold
    ],
)
def test_the_kernel_matches_the_reference(kernel, heads, kv_heads, head_dim, block_size, lens, interleaved):
    query, k_cache, v_cache, tables, context_lens = _case(
        len(lens), heads, kv_heads, head_dim, block_size, lens, interleaved
    )
    scale = head_dim**-0.5
    assert cpu_decode.handles(query, k_cache, v_cache)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # the padding's block: any read of it shows
    found = cpu_decode.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_the_new_tokens_are_stored_in_the_same_call_as_store_kv_stores_them(kernel):
    lens = [7, 16, 33]
    query, k_cache, v_cache, tables, context_lens = _case(3, 9, 3, 64, 16, lens, True, seed=2)
    fused = torch.randn(3, 9 + 3 + 3, 64)  # q, k, v of each token side by side, as the QKV projection leaves them
    key, value = fused[:, 9:12], fused[:, 12:]  # rows strided
    last = [n - 1 for n in lens]
    slots = torch.tensor([int(tables[i, p // 16]) * 16 + p % 16 for i, p in enumerate(last)])
    slots[1] = -1  # a padding row: stores nothing
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    expected = reference.paged_decode_attention(query, expected_k, expected_v, tables, context_lens, 0.125)
    found = cpu_decode.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.125, (key, value, slots))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


HALF_TYPES = [torch.float16, torch.bfloat16]


def _half_case(dtype, lens, seed):
    """_case with the runner's interleaved pool in dtype; the query stays fp32, as the model's."""
    query, k_cache, v_cache, tables, context_lens = _case(len(lens), 9, 3, 64, 16, lens, True, seed=seed)
    pool = k_cache.as_strided((k_cache.shape[0], 16, 2, 3, 64), (16 * 2 * 3 * 64, 2 * 3 * 64, 3 * 64, 64, 1))
    pool = pool.to(dtype)
    return query, pool[:, :, 0], pool[:, :, 1], tables, context_lens


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_a_half_precision_cache_is_read_and_written_as_pytorch_converts_it(kernel, dtype):
    if not cpu_decode.takes_kv_dtype(dtype):
        pytest.skip(f"this CPU's build does not convert {dtype} (no F16C)")
    lens = [1, 16, 17, 260, 33]
    query, k_cache, v_cache, tables, context_lens = _half_case(dtype, lens, seed=5)
    assert cpu_decode.handles(query, k_cache, v_cache)
    new_k, new_v = torch.randn(2, len(lens), 3, 64).unbind(0)
    new_k[0, 0, :4] = torch.tensor([1e-6, 6.1e4, -2.5e-8, 1 + 2**-12])  # below, above and between the steps
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(new_k, new_v, expected_k, expected_v, slots)  # PyTorch's rounding to dtype
    expected = reference.paged_decode_attention(query, expected_k, expected_v, tables, context_lens, 0.125)
    found = cpu_decode.paged_decode_attention(
        query, k_cache, v_cache, tables, context_lens, 0.125, (new_k, new_v, slots)
    )
    assert k_cache.view(torch.int16).equal(expected_k.view(torch.int16)), "the stored bits differ from PyTorch's"
    assert v_cache.view(torch.int16).equal(expected_v.view(torch.int16))
    assert found.dtype == torch.float32
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_the_avx2_build_reads_and_writes_a_half_precision_cache_alike(kernel, tmp_path, monkeypatch):
    # 8 lanes and F16C's conversions, as on a CPU without AVX-512: the same bits stored, the same output.
    if not cpu_decode.takes_kv_dtype(torch.float16):
        pytest.skip("this CPU's build does not convert float16 (no F16C)")
    lens = [3, 40, 17]
    query, k_cache, v_cache, tables, context_lens = _half_case(torch.float16, lens, seed=7)
    new_k, new_v = torch.randn(2, len(lens), 3, 64).unbind(0)
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    outputs = []
    for lib in (cpu_decode._lib, build.Library(cpu_decode.SOURCE, cpu_decode.SIGNATURES, "-", ("-mno-avx512f",))):
        if lib.loaded is None:
            assert lib.enable(tmp_path) == ""
        monkeypatch.setattr(cpu_decode, "_lib", lib)
        k, v = k_cache.clone(), v_cache.clone()
        out = cpu_decode.paged_decode_attention(query, k, v, tables, context_lens, 0.125, (new_k, new_v, slots))
        outputs.append((out, k.view(torch.int16), v.view(torch.int16)))
    (out8, k8, v8), (out16, k16, v16) = outputs[1], outputs[0]
    assert k8.equal(k16) and v8.equal(v16)
    torch.testing.assert_close(out8, out16, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_TYPES)
def test_the_prefill_kernel_reads_a_half_precision_cache(prefill_kernel, dtype):
    if not cpu_decode.takes_kv_dtype(dtype):
        pytest.skip(f"this CPU's build does not convert {dtype} (no F16C)")
    query, k_cache, v_cache, tables, lens = _half_case(dtype, [5, 100, 33, 70], seed=6)
    q_lens = [5, 40, 17, 1]
    query = torch.randn(sum(q_lens), 9, 64)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    assert cpu_prefill.handles(query, k_cache, v_cache)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.125)
    found = cpu_prefill.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, 0.125)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens, threads", [([300], 2), ([300], 4), ([260, 90], 4), ([200, 5, 64], 4), ([20], 2)])
def test_heads_split_between_threads_give_the_same_output_bit_for_bit(kernel, lens, threads):
    # Fewer sequences than threads: each sequence's heads are shared out (9 heads in 2, 3 or 4 parts, cutting
    # through KV groups), with each new token stored before any part reads it. Against one thread doing it all.
    query, k_cache, v_cache, tables, context_lens = _case(len(lens), 9, 3, 64, 16, lens, True, seed=4)
    new_k, new_v = torch.randn(2, len(lens), 3, 64).unbind(0)
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    found = {}
    before = torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            k, v = k_cache.clone(), v_cache.clone()
            out = cpu_decode.paged_decode_attention(query, k, v, tables, context_lens, 0.125, (new_k, new_v, slots))
            found[count] = out, k, v
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(found[1], found[threads]))
    reference.store_kv(new_k, new_v, k_cache, v_cache, slots)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.125)
    torch.testing.assert_close(found[threads][0], expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def prefill_kernel(tmp_path_factory):
    assert cpu_prefill.enable(tmp_path_factory.mktemp("kernels")) == ""
    yield
    cpu_prefill.disable()


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size, q_lens, context_lens, interleaved",
    [
        (9, 3, 64, 16, [512], [512], True),  # a whole prompt: 32 tiles of 16 rows
        (9, 3, 64, 16, [5, 40, 17, 1], [5, 100, 33, 70], True),  # after cached prefixes, tiles cut short
        (4, 4, 32, 8, [23, 9], [23, 41], False),  # no grouping, separate K and V tensors
        (8, 2, 128, 32, [33], [90], True),  # a group of 4, a wide head, 32-token blocks
        (6, 1, 16, 1, [20, 3], [20, 3], False),  # one KV head for all, one token per block
    ],
)
def test_the_prefill_kernel_matches_the_reference(
    prefill_kernel, heads, kv_heads, head_dim, block_size, q_lens, context_lens, interleaved
):
    query, k_cache, v_cache, tables, lens = _case(
        len(q_lens), heads, kv_heads, head_dim, block_size, context_lens, interleaved, seed=3
    )
    fused = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim)  # rows strided, as the QKV output leaves them
    query = fused[:, :heads]
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    assert cpu_prefill.handles(query, k_cache, v_cache)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, scale)
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # the tables' padding: never read
    found = cpu_prefill.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, scale)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        kernels.paged_prefill_attention(query, k_cache, v_cache, tables, cu_seqlens, lens, scale), expected
    )


def test_large_scores_do_not_overflow_and_a_dominant_key_wins(kernel):
    query, k_cache, v_cache, tables, lens = _case(2, 3, 1, 16, 4, [9, 30], True, seed=1)
    query *= 200.0  # scores in the thousands: e^score overflows fp32 without taking off the maximum first
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 1.0)
    found = cpu_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, 1.0)
    assert torch.isfinite(found).all()
    torch.testing.assert_close(found, expected, rtol=1e-4, atol=1e-4)


def test_the_dispatch_takes_the_kernel_only_for_what_it_handles(kernel):
    query, k_cache, v_cache, tables, lens = _case(3, 9, 3, 64, 16, [5, 40, 17], True)
    assert not kernels.needs_decode_plan(query, k_cache, v_cache)
    with torch.no_grad():
        half = [t.to(torch.bfloat16) for t in (query, k_cache, v_cache)]
    assert not cpu_decode.handles(*half) and kernels.needs_decode_plan(*half)  # bf16: the reference's
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125), expected)


def test_a_build_is_kept_and_a_missing_compiler_leaves_the_reference(tmp_path, monkeypatch):
    first = build.build(cpu_decode.SOURCE, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build.build(cpu_decode.SOURCE, tmp_path) == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setenv("CC", "no-such-compiler-kvferry")
    cpu_decode.disable()
    why = cpu_decode.enable(tmp_path / "elsewhere")
    assert "no-such-compiler-kvferry" in why
    query, k_cache, v_cache, *_ = _case(1, 2, 1, 8, 4, [3], True)
    assert not cpu_decode.handles(query, k_cache, v_cache) and kernels.needs_decode_plan(query, k_cache, v_cache)


def test_a_failing_compile_says_what_the_compiler_said(tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return }\n")
    lib, why = build.load(broken, tmp_path / "out")
    assert lib is None and "failed" in why and "error" in why
    assert not list((tmp_path / "out").glob("*.so"))  # no half-built library left to load later


@pytest.fixture(scope="module")
def elementwise(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    assert layer_ops.enable(folder) == ""
    yield folder
    layer_ops.disable()


def _torch_rope(x, cos, sin):  # transformers' rotate_half, as PyTorch ops
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


@pytest.mark.parametrize("rows, dim", [(1, 576), (40, 576), (3, 24), (200, 1000)])  # one vector's tail, threads
def test_the_residual_add_is_exact_and_the_norm_matches(elementwise, rows, dim):
    generator = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(n, generator=generator) for n in ((rows, dim), (rows, dim), (dim,)))
    expected_sum = x + residual
    expected = F.rms_norm(expected_sum, (dim,), weight, 1e-5)
    assert layer_ops.handles(x, residual, weight)
    out, summed = layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert summed is residual and torch.equal(residual, expected_sum)  # in place, bit for bit
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    alone, passed = layer_ops.add_rms_norm(x, None, weight, 1e-5)
    assert passed is x
    torch.testing.assert_close(alone, F.rms_norm(x, (dim,), weight, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (33, 12, 64), (500, 6, 24)])
def test_rope_in_place_is_bit_for_bit_pytorchs(elementwise, rows, heads, head_dim):
    generator = torch.Generator().manual_seed(heads)
    fused = torch.randn(rows, heads + 5, head_dim, generator=generator)  # rows strided: q and k beside v
    x = fused[:, :heads]
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    expected, untouched = _torch_rope(x, cos, sin), fused[:, heads:].clone()
    assert layer_ops.rope_handles(x, cos, sin)
    assert layer_ops.rope_(x, cos, sin).data_ptr() == x.data_ptr()
    assert torch.equal(x, expected) and torch.equal(fused[:, heads:], untouched)


@pytest.mark.parametrize("rows, width", [(1, 1536), (32, 1536), (5, 40)])
def test_silu_mul_matches(elementwise, rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, -88.5, 0.0])  # past the exponential's clamps, and zero
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), expected, rtol=1e-5, atol=1e-6)


def test_the_model_uses_pytorchs_ops_where_the_functions_are_not_loaded(elementwise):
    x = torch.randn(3, 4, 16)
    cos, sin = torch.ones(3, 16), torch.zeros(3, 16)
    assert layer_ops.rope_handles(x, cos, sin) and not layer_ops.rope_handles(x.to(torch.bfloat16), cos, sin)
    assert not layer_ops.rope_handles(x.transpose(1, 2), cos, sin)  # a head's vector not contiguous
    layer_ops.disable()
    try:
        assert not layer_ops.handles(x) and not layer_ops.rope_handles(x, cos, sin)
    finally:
        assert layer_ops.enable(elementwise) == ""


@pytest.mark.parametrize("rows, with_outliers", [(1, True), (32, True), (7, False), (300, True)])
def test_int8_activations_in_c_equal_the_pytorch_ops_bit_for_bit(elementwise, rows, with_outliers):
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 40)
    x = torch.randn(rows, 96, generator=generator) * 3
    x[:, 5] *= 50  # a loud channel
    x[0] = 0.0  # a silent row: its scale is the floor, 1e-12 / 127
    outliers = torch.tensor([5, 17, 90]) if with_outliers else None
    layer = Int8Linear(linear, outliers)
    with torch.no_grad():
        fused = layer(x)
        layer_ops.disable()
        try:
            expected = layer(x)
        finally:
            assert layer_ops.enable(elementwise) == ""
    if with_outliers:
        # The float channels' product is the one part summed differently: in C in a fixed order whatever the row
        # count (outlier_columns.h), by PyTorch's addmm in its own. They agree to the last bits of that product.
        product = (x[:, outliers] @ layer.outlier_weight.float()).abs().amax()
        assert (fused - expected).abs().max() <= 4 * torch.finfo(torch.float32).eps * (product + expected.abs().amax())
    else:
        assert torch.equal(fused, expected)
    xq, row_scale, x_out = layer_ops.quantize_rows(x, outliers)
    if with_outliers:
        assert torch.equal(x_out, x[:, outliers]) and (xq[:, outliers] == 0).all()
    assert (xq[1:].abs().amax(1) == 127).all() and row_scale[0, 0] == torch.tensor(1e-12) / 127  # each row's own


@pytest.mark.parametrize("dim", [5, 8, 37, 576, 1536])
def test_quantized_activations_equal_the_pytorch_ops_bit_for_bit(elementwise, dim):
    # Each row's int8 values and scale, against int8_rows_matmul's ops on the row with its outliers zeroed: halves
    # that round to even, both clamps, infinities, outliers at the ends and side by side, and rows whose width is
    # not a whole number of vectors (the scalar tail). A NaN is left out of the scale (amax would spread it) and
    # quantizes to -127.
    generator = torch.Generator().manual_seed(dim)
    x = torch.randn(6, dim, generator=generator) * 4
    x[1] = ((torch.arange(dim) + 3) % 23 - 11) * 0.5  # with 127 its largest, the scale is 1: halves to round to even
    x[1, dim // 2] = 127.0
    x[2, dim // 2] = float("nan")
    x[3, dim // 2], x[3, dim // 2 + 1] = float("inf"), float("-inf")  # the scale is infinite: inf / inf is NaN
    x[4] = 0.0
    x[5, -1] = 1e30  # an outlier: left out of the scale
    outliers = torch.tensor(sorted({0, 1, dim // 3, dim - 1}))
    xq, row_scale, x_out = layer_ops.quantize_rows(x, outliers)
    zeroed = x.index_fill(1, outliers, 0.0)
    magnitude = zeroed.abs()
    scale = magnitude.masked_fill(magnitude.isnan(), 0.0).amax(dim=1, keepdim=True).clamp_min(1e-12).div(127.0)
    quantized = torch.round(zeroed / scale)
    expected = quantized.masked_fill(quantized.isnan(), -127.0).clamp(-127, 127).to(torch.int8)
    assert torch.equal(row_scale, scale) and torch.equal(xq, expected) and torch.equal(x_out, x[:, outliers])
    assert row_scale[1] == 1.0 and (zeroed[1].frac().abs() == 0.5).any()
    assert xq[2, dim // 2] == -127 and (xq[3] == -127).sum() == 2 and xq[5, -1] == 0


def test_the_outlier_columns_widen_half_precision_weights_exactly(elementwise):
    # Weights down to fp16's smallest subnormal, in the sixteen-column vector part and in the scalar tail, with
    # products and sums that fp32 holds exactly: any mistake in widening a half shows as an unequal output.
    tiny = 2.0**-24  # fp16's smallest subnormal
    values = [tiny, -3 * tiny, 1023 * tiny, 2.0**-14, -1.5 * 2.0**-14, 0.0, -0.0, 7 * tiny, 2.0**-13]
    generator = torch.Generator().manual_seed(0)
    wt = torch.tensor(values)[torch.randint(len(values), (3, 20), generator=generator)].to(torch.float16)
    x_out = torch.tensor([[1.0, 2.0, 0.5], [-4.0, 0.25, 8.0]])
    y = torch.zeros(2, 20)
    layer_ops.add_outlier_columns(y, x_out, wt, None)
    exact = (x_out.double() @ wt.double()).float()
    assert torch.equal(y, exact)
    assert ((wt.float().abs() < 2.0**-14) & (wt != 0)).any()  # subnormals are really in it
