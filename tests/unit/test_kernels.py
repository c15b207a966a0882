"""Every Triton kernel against the PyTorch reference under TRITON_INTERPRET=1, and the reference
against plain dense attention."""

import math

import pytest
import torch

from kvferry.kernels import reference
from kvferry.kernels.triton.decode_attention import paged_decode_attention as triton_decode
from kvferry.kernels.triton.prefill_attention import paged_prefill_attention as triton_prefill
from kvferry.kernels.triton.store_kv import store_kv as triton_store_kv

SHAPES = [  # (num_heads, num_kv_heads, head_dim)
    (4, 4, 16),  # MHA
    (6, 2, 32),  # GQA, group 3
    (4, 1, 24),  # MQA, head_dim not a power of two
]


def make_paged(context_lens, block_size, num_kv_heads, head_dim, seed=0):
    """A shuffled pool, so that the tables are not contiguous, with random K/V in every slot."""
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


def dense_attention(q, k, v, scale, q_offset):
    """q [q_len, H, d] at positions q_offset.., k/v [ctx, kvh, d]; causal."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + q_offset
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_store_kv_matches_reference(block_size, shape):
    _, num_kv_heads, head_dim = shape
    g = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 13
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(4)]
    reference.store_kv(key, value, caches[0], caches[1], slots)
    triton_store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[2].view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots], key)


def test_store_kv_skips_padding_rows_with_a_negative_slot():
    """A decode graph's padding rows carry slot -1: both implementations store the real rows and nothing else."""
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, -1, 17, -1, -1])
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    for store in (reference.store_kv, triton_store_kv):
        k_cache, v_cache = torch.zeros(3, 8, 2, 16), torch.zeros(3, 8, 2, 16)
        store(key, value, k_cache, v_cache, slots)
        flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
        assert torch.equal(flat_k[[5, 17]], key[[0, 2]]) and torch.equal(flat_v[[5, 17]], value[[0, 2]])
        written = (flat_k != 0).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert written == [5, 17]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ragged", [True, False])
def test_decode_attention_matches_reference(block_size, shape, ragged):
    num_heads, num_kv_heads, head_dim = shape
    if ragged:  # exact block ends included
        context_lens = [1, block_size, 3 * block_size + 5, 70, 2, 33, block_size + 1, 9, 64, 17, 5]
    else:
        context_lens = [2 * block_size + 3] * 3
    k_cache, v_cache, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    out = triton_decode(q, k_cache, v_cache, block_tables, lens, scale)
    assert (out - ref).abs().max().item() <= 1e-4
    for i, n in enumerate(context_lens):  # the reference itself against dense attention
        k = reference.gather_context(k_cache, block_tables[i], n)
        v = reference.gather_context(v_cache, block_tables[i], n)
        dense = dense_attention(q[i : i + 1], k, v, scale, q_offset=n - 1)
        assert (ref[i : i + 1] - dense).abs().max().item() <= 1e-5


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


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_attention_over_paged_prefix_matches_reference(block_size, shape):
    num_heads, num_kv_heads, head_dim = shape
    # (prefix already cached, new tokens): plain prompts, a chunk after a prefix, single tokens
    cases = [(0, 37), (block_size + 3, 20), (2 * block_size, 1), (5, 40)]
    context_lens = [p + n for p, n in cases]
    k_cache, v_cache, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    q_lens = [n for _, n in cases]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = 1 / math.sqrt(head_dim)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, lens, scale)
    out = triton_prefill(q, k_cache, v_cache, block_tables, cu, lens, scale)
    assert (out - ref).abs().max().item() <= 1e-4
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
    k_sep, v_sep, block_tables = make_paged(context_lens, block_size, num_kv_heads, head_dim)
    kv = torch.stack((k_sep, v_sep), dim=2)  # [num_blocks, block_size, 2, kvh, d]
    k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    assert reference.interleaved_blocks(k_cache, v_cache) is not None
    assert reference.interleaved_blocks(k_sep, v_sep) is None and reference.interleaved_blocks(v_cache, k_cache) is None
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g)
    lens, scale = torch.tensor(context_lens, dtype=torch.int32), 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(q, k_sep, v_sep, block_tables, lens, scale)
    assert (
        reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale) - expected
    ).abs().max() <= 1e-6
    assert (triton_decode(q, k_cache, v_cache, block_tables, lens, scale) - expected).abs().max() <= 1e-4
    cu = torch.tensor([0] + torch.tensor(context_lens).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(sum(context_lens), num_heads, head_dim, generator=g)
    expected = reference.paged_prefill_attention(qp, k_sep, v_sep, block_tables, cu, lens, scale)
    assert (
        reference.paged_prefill_attention(qp, k_cache, v_cache, block_tables, cu, lens, scale) - expected
    ).abs().max() <= 1e-6
    assert (triton_prefill(qp, k_cache, v_cache, block_tables, cu, lens, scale) - expected).abs().max() <= 1e-4

    slots = torch.tensor([0, 17, 40, 5 * block_size + 3, -1])
    key, value = (
        torch.randn(5, num_kv_heads, head_dim, generator=g),
        torch.randn(5, num_kv_heads, head_dim, generator=g),
    )
    for store in (reference.store_kv, triton_store_kv):
        target = torch.zeros_like(kv)
        store(key, value, target[:, :, 0], target[:, :, 1], slots)
        rows = target.view(-1, 2, num_kv_heads, head_dim)  # [slots, K/V, kvh, d]
        assert torch.equal(rows[slots[:4], 0], key[:4]) and torch.equal(rows[slots[:4], 1], value[:4])
        assert torch.count_nonzero(target) == torch.count_nonzero(key[:4]) + torch.count_nonzero(value[:4])
