"""Every Triton kernel against the PyTorch reference, in fp32, fp16 and bf16, and the reference against plain dense
attention. On a CUDA machine the kernels run compiled; elsewhere through the interpreter (tests/conftest.py)."""

import math

import pytest
import torch

from kvferry.kernels import reference
from kvferry.kernels.triton import decode_attention, launch_config
from kvferry.kernels.triton.decode_attention import paged_decode_attention as triton_decode
from kvferry.kernels.triton.decode_attention import paged_decode_attention_split as triton_decode_split
from kvferry.kernels.triton.prefill_attention import paged_prefill_attention as triton_prefill
from kvferry.kernels.triton.store_kv import store_kv as triton_store_kv
from tests.kernel_dtypes import DEVICE, DTYPES, rounding_tolerance

ON_GPU = DEVICE.type == "cuda"

SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (4, 4, 16),  # MHA
    (6, 2, 32),  # GQA, group 3
    (4, 1, 24),  # MQA, head_dim not a power of two
]
# (num_heads, num_kv_heads, head_dim, block_size) for the dtype sweep: GQA groups above 1 and the head sizes of real
# models; the interpreter is slow, so the larger ones run only compiled.
CASES = [(4, 4, 16, 8), (6, 2, 32, 32), (4, 1, 24, 16), (8, 2, 64, 16), (4, 2, 128, 16)]
if ON_GPU:
    CASES += [(9, 3, 64, 16), (32, 8, 128, 16), (8, 1, 256, 16), (16, 2, 256, 32)]


def make_paged(context_lens, block_size, num_kv_heads, head_dim, seed=0):
    """A shuffled pool, so that the tables are not contiguous, with random K/V in every slot (fp32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, cursor = [], 0
    for n in blocks_per_seq:
        tables.append(perm[cursor : cursor + n])
        cursor += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return k_cache, v_cache, block_tables


def on_device(*tensors, dtype=None):
    return [t.to(DEVICE, dtype=dtype if t.is_floating_point() else None) for t in tensors]


def attention_tolerance(dtype, values, reduction_len):
    """The output is a convex combination of V's rows. Rounding P to dtype before P.V, and the output after, each
    move it by at most half an eps of max|V|; the fp32 sums over reduction_len terms, in the kernel and in the
    reference, add rounding that grows like the square root of their length."""
    return rounding_tolerance(values.abs().max().item(), dtype, reduction_len)


def assert_matches_fp32_reference(out, expected, dtype, values, reduction_len):
    assert out.dtype == dtype
    error = (out.float() - expected).abs().max().item()
    assert error <= attention_tolerance(dtype, values, reduction_len), (dtype, error)


def dense_attention(q, k, v, scale, q_offset):
    """q [q_len, H, d] at positions q_offset.., k/v [ctx, kvh, d]; causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0], device=q.device)[:, None] + q_offset
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_store_kv_matches_reference(block_size, shape):
    _, num_kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 13
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # a copy: exact in every dtype
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)] * 4
        caches = [c.clone() for c in caches]
        reference.store_kv(key, value, caches[0], caches[1], slots)
        triton_store_kv(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        flat = caches[2].view(-1, num_kv_heads, head_dim)
        assert torch.equal(flat[slots], key)


def test_store_kv_skips_padding_rows_with_a_negative_slot():
    """A decode graph's padding rows carry slot -1: both implementations store the real rows and nothing else."""
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, -1, 17, -1, -1], device=DEVICE)
    key, value = on_device(torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g))
    for store in (reference.store_kv, triton_store_kv):
        k_cache, v_cache = on_device(torch.zeros(3, 8, 2, 16), torch.zeros(3, 8, 2, 16))
        store(key, value, k_cache, v_cache, slots)
        flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
        assert torch.equal(flat_k[[5, 17]], key[[0, 2]]) and torch.equal(flat_v[[5, 17]], value[[0, 2]])
        written = (flat_k != 0).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert written == [5, 17]


def decode_inputs(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=2):
    k_cache, v_cache, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    q, k_cache, v_cache = on_device(q, k_cache, v_cache, dtype=dtype)
    block_tables, lens = on_device(block_tables, torch.tensor(context_lens, dtype=torch.int32))
    return q, k_cache, v_cache, block_tables, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_decode_attention_matches_reference(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size = case
    context_lens = [1, block_size, 3 * block_size + 5, 70, 2, 33, block_size + 1, 9, 64]  # exact block ends included
    q, k_cache, v_cache, block_tables, lens = decode_inputs(
        context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = 1 / math.sqrt(head_dim)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale)
    reduction_len = max(context_lens) + head_dim
    out = triton_decode_split(q, k_cache, v_cache, block_tables, lens, scale, num_splits=1)
    assert_matches_fp32_reference(out, ref, dtype, v_cache, reduction_len)
    # Three splits: the short contexts leave some empty, which must weigh nothing.
    out = triton_decode_split(q, k_cache, v_cache, block_tables, lens, scale, num_splits=3)
    assert_matches_fp32_reference(out, ref, dtype, v_cache, reduction_len)
    if dtype == torch.float32:  # the reference itself against dense attention
        for i, n in enumerate(context_lens):
            k = reference.gather_context(k_cache, block_tables[i], n)
            v = reference.gather_context(v_cache, block_tables[i], n)
            dense = dense_attention(q[i : i + 1], k, v, scale, q_offset=n - 1)
            assert (ref[i : i + 1] - dense).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_decode_of_one_long_context_matches_reference(dtype, monkeypatch):
    """Batch 1 leaves a GPU idle without splits: the wrapper cuts the long context, from shapes alone."""
    num_heads, num_kv_heads, head_dim, block_size = (6, 2, 64, 16) if not ON_GPU else (9, 3, 64, 16)
    context_len = 4 * launch_config.MIN_SPLIT_TOKENS - 7 if not ON_GPU else 8000
    q, k_cache, v_cache, block_tables, lens = decode_inputs(
        [context_len], num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    chosen = []

    def spy(*args):
        chosen.append(args[-1])
        return triton_decode_split(*args)

    monkeypatch.setattr(decode_attention, "paged_decode_attention_split", spy)
    scale = 1 / math.sqrt(head_dim)
    out = triton_decode(q, k_cache, v_cache, block_tables, lens, scale)
    expected_splits = launch_config.decode_splits(
        1, num_kv_heads, block_tables.shape[1] * block_size, launch_config.target_programs(DEVICE)
    )
    assert chosen == [expected_splits] and expected_splits > 1
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale)
    assert_matches_fp32_reference(out, ref, dtype, v_cache, context_len + head_dim)


def test_decode_splits_are_sized_by_the_block_table_not_by_the_contexts():
    """A decode graph's tables are as wide as the longest allowed context, whatever the contexts are: the split count
    follows the width, and the splits past a short context are empty."""
    head_dim, block_size = 32, 16
    q, k_cache, v_cache, block_tables, lens = decode_inputs([5, 40], 4, 2, head_dim, block_size, torch.float32)
    wide = torch.zeros(2, 64, dtype=torch.int32, device=DEVICE)
    wide[:, : block_tables.shape[1]] = block_tables
    scale = 1 / math.sqrt(head_dim)
    num_splits = launch_config.decode_splits(2, 2, 64 * block_size, launch_config.target_programs(DEVICE))
    assert num_splits > 1
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    assert_matches_fp32_reference(
        triton_decode(q, k_cache, v_cache, wide, lens, scale), ref, torch.float32, v_cache, 40 + head_dim
    )


def test_decode_passes_cover_every_sequence_in_order_within_the_byte_budget(monkeypatch):
    k_cache = torch.zeros(90, 4, 1, 4)  # blocks of 4 tokens: 128 bytes of K and V each
    monkeypatch.setattr(reference, "DECODE_GATHER_BYTES", 1280)  # 10 blocks per pass
    context_lens = [4, 8, 5, 40, 3, 3, 3, 12, 1]  # blocks: 1 2 2 10 1 1 1 3 1
    block_tables = torch.arange(len(context_lens) * 10, dtype=torch.int32).view(len(context_lens), 10)
    plan = reference.plan_decode(block_tables, torch.tensor(context_lens, dtype=torch.int32), k_cache)
    assert [(c.start, c.end) for c in plan] == [(0, 3), (3, 4), (4, 7), (7, 9)]
    for c in plan:
        width = -(-c.longest // 4)
        assert c.longest == max(context_lens[c.start : c.end])
        assert c.rows.tolist() == block_tables[c.start : c.end, :width].flatten().tolist()
        assert c.end - c.start == 1 or (c.end - c.start) * width * 128 <= 1280  # padded to the longest
        if len(set(context_lens[c.start : c.end])) == 1:
            assert c.mask is None
        else:
            visible = c.mask[:, 0, 0, :].sum(dim=1).tolist()
            assert visible == context_lens[c.start : c.end]


@pytest.mark.parametrize("interleaved", [False, True])
def test_decode_attention_in_many_small_passes_matches_dense_attention(interleaved, monkeypatch):
    num_heads, num_kv_heads, head_dim = SHAPES[1]
    block_size, context_lens = 8, [1, 8, 29, 70, 2, 33, 9, 64, 17, 5]
    k_cache, v_cache, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    if interleaved:  # the runner's layout
        kv = torch.stack((k_cache, v_cache), dim=2)
        k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    monkeypatch.setattr(reference, "DECODE_GATHER_BYTES", 5 * 2 * block_size * num_kv_heads * head_dim * 4)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    plan = reference.plan_decode(block_tables, lens, k_cache)
    assert len(plan) > 5 and any(c.end - c.start > 1 for c in plan)  # many passes, one of several sequences
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    scale = 1 / math.sqrt(head_dim)
    out = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    for i, n in enumerate(context_lens):
        k = reference.gather_context(k_cache, block_tables[i], n)
        v = reference.gather_context(v_cache, block_tables[i], n)
        assert (out[i : i + 1] - dense_attention(q[i : i + 1], k, v, scale, q_offset=n - 1)).abs().max().item() <= 1e-5


H100_SHARED_MEMORY = 227 * 1024  # its opt-in limit per program


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_attention_tiles_fit_shared_memory_and_registers(head_dim, elem_bytes):
    per_thread = launch_config.TILE_PER_THREAD_FP32 if elem_bytes == 4 else launch_config.TILE_PER_THREAD
    for limit in (H100_SHARED_MEMORY, launch_config.FALLBACK_SHARED_MEMORY):
        budget = limit * 3 // 4
        for tiles in (
            launch_config.prefill_tiles(head_dim, elem_bytes, budget),
            launch_config.decode_tiles(16, head_dim, elem_bytes, budget),
        ):
            assert launch_config.shared_bytes(tiles, head_dim, elem_bytes) <= budget
            for size in (tiles.block_m, tiles.block_n):
                assert size >= launch_config.MIN_DOT and size & (size - 1) == 0
            threads = tiles.num_warps * 32
            for rows, cols in ((tiles.block_m, head_dim), (tiles.block_n, head_dim), (tiles.block_m, tiles.block_n)):
                assert rows * cols <= threads * per_thread  # Q and the accumulator, K and V, the scores
            assert tiles.num_warps in (4, 8) and tiles.num_stages in (1, 2)


def test_larger_heads_get_smaller_tiles_and_small_ones_keep_full_tiles():
    budget = H100_SHARED_MEMORY * 3 // 4
    for elem_bytes in (2, 4):
        tiles = {d: launch_config.prefill_tiles(d, elem_bytes, budget) for d in (64, 128, 256)}
        areas = [tiles[d].block_m * tiles[d].block_n for d in (64, 128, 256)]
        assert areas == sorted(areas, reverse=True) and areas[0] > areas[2]
    assert launch_config.prefill_tiles(64, 2, budget) == launch_config.Tiles(64, 64, 4, 2)  # bf16 fits untouched
    assert launch_config.decode_tiles(16, 64, 2, budget) == launch_config.Tiles(16, 64, 4, 2)


def test_decode_splits_fill_the_device_only_when_sequences_are_few_and_long():
    target, least = 264, launch_config.MIN_SPLIT_TOKENS
    assert launch_config.decode_splits(64, 8, 100 * least, target) == 1  # batch * kv heads already fills it
    assert launch_config.decode_splits(1, 3, 2 * least - 1, target) == 1  # too short for two parts
    assert launch_config.decode_splits(1, 3, 5 * least, target) == 5  # as many parts as the length allows
    assert launch_config.decode_splits(4, 8, 100 * least, target) == 9  # 32 programs need 9 parts to pass 264
    assert launch_config.decode_splits(1, 1, 1000 * least, target) == launch_config.MAX_SPLITS


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_prefill_attention_over_paged_prefix_matches_reference(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size = case
    # (prefix already cached, new tokens): plain prompts, a chunk after a prefix, single tokens
    cases = [(0, 37), (block_size + 3, 20), (2 * block_size, 1), (5, 40)]
    if ON_GPU:  # a long prompt, and a long chunk after a long prefix: many query and key tiles
        cases += [(0, 700), (1000, 300)]
    context_lens = [p + n for p, n in cases]
    k_cache, v_cache, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    q_lens = [n for _, n in cases]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    q, k_cache, v_cache = on_device(q, k_cache, v_cache, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    block_tables, cu, lens = on_device(block_tables, cu, torch.tensor(context_lens, dtype=torch.int32))
    scale = 1 / math.sqrt(head_dim)
    ref = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, cu, lens, scale)
    out = triton_prefill(q, k_cache, v_cache, block_tables, cu, lens, scale, max_q_len=max(q_lens))
    assert_matches_fp32_reference(out, ref, dtype, v_cache, max(context_lens) + head_dim)
    if dtype == torch.float32:  # the reference itself against dense attention
        for i, (prefix, n) in enumerate(cases):
            k = reference.gather_context(k_cache, block_tables[i], prefix + n)
            v = reference.gather_context(v_cache, block_tables[i], prefix + n)
            dense = dense_attention(q[cu[i] : cu[i + 1]], k, v, scale, q_offset=prefix)
            assert (ref[cu[i] : cu[i + 1]] - dense).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_every_operation_takes_the_runners_interleaved_cache(shape):
    """The runner keeps K and V as halves of one [num_blocks, block_size, 2, kvh, d] tensor; each operation on
    those strided views gives what it gives on two separate tensors, and writes where the layout says."""
    num_heads, num_kv_heads, head_dim = shape
    block_size, context_lens = 16, [1, 16, 53, 70, 2, 33, 17, 9, 64, 5]
    k_sep, v_sep, block_tables = on_device(*make_paged(context_lens, block_size, num_kv_heads, head_dim))
    kv = torch.stack((k_sep, v_sep), dim=2)  # [num_blocks, block_size, 2, kvh, d]
    k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    assert reference.interleaved_blocks(k_cache, v_cache) is not None
    assert reference.interleaved_blocks(k_sep, v_sep) is None and reference.interleaved_blocks(v_cache, k_cache) is None
    g = torch.Generator().manual_seed(4)
    (q,) = on_device(torch.randn(len(context_lens), num_heads, head_dim, generator=g))
    lens, scale = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), 1 / math.sqrt(head_dim)
    tolerance = attention_tolerance(torch.float32, v_sep, max(context_lens) + head_dim)
    expected = reference.paged_decode_attention(q, k_sep, v_sep, block_tables, lens, scale)
    assert (
        reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale) - expected
    ).abs().max() <= 1e-6
    for num_splits in (1, 2):
        out = triton_decode_split(q, k_cache, v_cache, block_tables, lens, scale, num_splits)
        assert (out - expected).abs().max() <= tolerance
    cu = torch.tensor([0] + torch.tensor(context_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    (qp,) = on_device(torch.randn(sum(context_lens), num_heads, head_dim, generator=g))
    expected = reference.paged_prefill_attention(qp, k_sep, v_sep, block_tables, cu, lens, scale)
    assert (
        reference.paged_prefill_attention(qp, k_cache, v_cache, block_tables, cu, lens, scale) - expected
    ).abs().max() <= 1e-6
    assert (triton_prefill(qp, k_cache, v_cache, block_tables, cu, lens, scale) - expected).abs().max() <= tolerance

    slots = torch.tensor([0, 17, 40, 5 * block_size + 3, -1], device=DEVICE)
    key, value = on_device(
        torch.randn(5, num_kv_heads, head_dim, generator=g), torch.randn(5, num_kv_heads, head_dim, generator=g)
    )
    for store in (reference.store_kv, triton_store_kv):
        target = torch.zeros_like(kv)
        store(key, value, target[:, :, 0], target[:, :, 1], slots)
        rows = target.view(-1, 2, num_kv_heads, head_dim)  # [slots, K/V, kvh, d]
        assert torch.equal(rows[slots[:4], 0], key[:4]) and torch.equal(rows[slots[:4], 1], value[:4])
        assert torch.count_nonzero(target) == torch.count_nonzero(key[:4]) + torch.count_nonzero(value[:4])
