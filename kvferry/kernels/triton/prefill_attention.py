"""Triton: prefill attention of new tokens over a paged prefix (flash-attention style, causal).

Q, K and V stay in the cache's dtype, so that bf16 and fp16 dots run on the tensor cores; scores, the softmax
statistics and the output accumulate in fp32.
"""

import math

import torch
import triton
import triton.language as tl

from kvferry.kernels.triton.launch_config import dot_precision, prefill_tiles, shared_memory_budget


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    stride_c_block,
    stride_c_tok,
    stride_c_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        prefix_len = context_len - q_len
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
        mask_m = offs_m < q_len
        query_pos = prefix_len + offs_m
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        ).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_M, D]
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        # Causality: no query in this tile sees past its last position.
        kv_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)
        for start in range(0, kv_end, BLOCK_N):
            key_pos = start + offs_n  # [BLOCK_N]
            mask_n = key_pos < kv_end
            # int64: block_id * stride overflows int32 once one layer's cache passes 2^31 elements.
            block_id = tl.load(block_tables_ptr + seq * stride_bt_s + key_pos // BLOCK_SIZE, mask=mask_n, other=0).to(
                tl.int64
            )
            base = block_id * stride_c_block + (key_pos % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            # Scores in log2 units (qk_scale folds in log2(e)): exp2 is the cheaper instruction.
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32) * qk_scale
            visible = (key_pos[None, :] <= query_pos[:, None]) & mask_n[None, :]
            scores = tl.where(visible, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # Rows that have seen no key yet keep m = -inf; guard their rescale against nan.
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            # p in [0, 1] rounded to V's dtype, as flash-attention does, so that P.V is a tensor-core dot too.
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION, out_dtype=tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + (q_start + offs_m)[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert cu_seqlens_q.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    out = torch.empty_like(query)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tiles = prefill_tiles(head_dim_pad, k_cache.element_size(), shared_memory_budget(query.device))
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, tiles.block_m))
    _paged_prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * math.log2(math.e),
        *query.stride()[:2],
        block_tables.stride(0),
        *out.stride()[:2],
        *k_cache.stride()[:3],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(k_cache.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
