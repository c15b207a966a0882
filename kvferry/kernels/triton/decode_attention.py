"""Triton: paged decode attention, one query token per sequence, online softmax over its blocks."""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_q_b,
    stride_q_h,
    stride_bt_b,
    stride_o_b,
    stride_o_h,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_b + head * stride_q_h + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, context_len, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N] token positions
        mask_n = pos < context_len
        # Looking the block up per token lets BLOCK_N differ from the cache's block size; int64, as
        # block_id * stride overflows int32 once one layer's cache passes 2^31 elements.
        block_id = tl.load(block_tables_ptr + seq * stride_bt_b + pos // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        base = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_N]
        scores = tl.where(mask_n, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_o_b + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert query.stride(2) == 1 and k_cache.stride(3) == 1
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,) and block_tables.stride(1) == 1
    out = torch.empty_like(query)
    _paged_decode_kernel[(batch, num_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=64,
    )
    return out
