"""Triton: paged decode attention, one query token per sequence, online softmax over its blocks.

A program serves one GQA group, reading each K and V tile once for all its query heads. With few sequences a long
context is cut into splits (flash-decoding), each writing its partial softmax state to fp32 scratch for a second
kernel to combine. Every setting follows from shapes alone, so that a CUDA graph replays the launch it captured.
"""

import math

import torch
import triton
import triton.language as tl

from kvferry.kernels.triton.launch_config import (
    decode_splits,
    decode_tiles,
    dot_precision,
    shared_memory_budget,
    target_programs,
)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    qk_scale,
    num_heads,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    stride_o_b,
    stride_o_h,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    # Each sequence cuts its own context into NUM_SPLITS runs of whole BLOCK_N steps; trailing splits of a
    # short context are empty and report an empty softmax state.
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(context_len, start + split_len)
    offs_g = tl.arange(0, GROUP_PAD)
    mask_g = offs_g < GROUP
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads that share this kv head
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_gd = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :], mask=mask_gd, other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)  # [GROUP_PAD, D]
    m_i = tl.full([GROUP_PAD], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + offs_n  # [BLOCK_N] token positions
        mask_n = pos < end
        # Looking the block up per token lets BLOCK_N differ from the cache's block size; int64, as
        # block_id * stride overflows int32 once one layer's cache passes 2^31 elements.
        block_id = tl.load(block_tables_ptr + seq * stride_bt_b + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        base = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        # Scores in log2 units (qk_scale folds in log2(e)): exp2 is the cheaper instruction.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32) * qk_scale
        scores = tl.where(mask_n[None, :], scores, -float("inf"))  # [GROUP_PAD, BLOCK_N]
        # The step's first key is always visible, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        # p in [0, 1] rounded to V's dtype, as flash-attention does, so that P.V is a tensor-core dot too.
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + seq * stride_o_b + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_gd)
    else:
        # Scratch rows: [batch, num_heads, NUM_SPLITS], each with HEAD_DIM accumulators and (max, sum).
        rows = ((seq * num_heads + heads) * NUM_SPLITS + split).to(tl.int64)  # [GROUP_PAD]
        tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_gd)
        tl.store(part_stats_ptr + rows * 2, m_i, mask=mask_g)
        tl.store(part_stats_ptr + rows * 2 + 1, l_i, mask=mask_g)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,
    part_stats_ptr,
    out_ptr,
    num_heads,
    stride_o_b,
    stride_o_h,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    rows = (seq * num_heads + head).to(tl.int64) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    split_max = tl.load(part_stats_ptr + rows * 2, mask=mask_s, other=-float("inf"))
    split_sum = tl.load(part_stats_ptr + rows * 2 + 1, mask=mask_s, other=0.0)
    acc_ptrs = part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [SPLITS_PAD, D]
    # Split 0 holds the first key of a context (at least one token), so m_max is finite; an empty split's max of -inf weighs 0.
    m_max = tl.max(split_max, axis=0)
    weight = tl.where(mask_s, tl.exp2(split_max - m_max), 0.0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.sum(weight * split_sum, axis=0)
    out_ptrs = out_ptr + seq * stride_o_b + head * stride_o_h + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch, _, _ = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # The table's width bounds every context: known from shapes, so no device sync, graph-safe.
    longest_possible = block_tables.shape[1] * block_size
    num_splits = decode_splits(batch, num_kv_heads, longest_possible, target_programs(query.device))
    return paged_decode_attention_split(query, k_cache, v_cache, block_tables, context_lens, scale, num_splits)


def paged_decode_attention_split(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """paged_decode_attention with the number of splits given (tests force either path with it)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert query.stride(2) == 1 and k_cache.stride(3) == 1
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,) and block_tables.stride(1) == 1
    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tiles = decode_tiles(group_pad, head_dim_pad, k_cache.element_size(), shared_memory_budget(query.device))
    out = torch.empty_like(query)
    # Scratch sized by shapes only; with one split it is never written, so a stand-in suffices.
    scratch = dict(dtype=torch.float32, device=query.device)
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, **scratch)
        part_stats = torch.empty(batch, num_heads, num_splits, 2, **scratch)  # (max, sum) in log2 units
    else:
        part_acc = part_stats = out
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_stats,
        scale * math.log2(math.e),
        num_heads,
        *query.stride()[:2],
        block_tables.stride(0),
        *out.stride()[:2],
        *k_cache.stride()[:3],
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=tiles.block_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            part_acc,
            part_stats,
            out,
            num_heads,
            *out.stride()[:2],
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out
