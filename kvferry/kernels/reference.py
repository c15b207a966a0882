"""PyTorch versions of the paged-attention operations.

They run on the CPU and are the oracle that the Triton kernels are tested against.
Cache layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim]. A block table
row lists a sequence's block ids; entries past its context are padding (any valid id).
"""
import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V into its slot (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)  # [num_slots, kvh, d]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's cached K or V as a contiguous [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:context_len]


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence attending to its whole cached context.
    query [batch, num_heads, head_dim], block_tables [batch, max_blocks], context_lens [batch]."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    # Gathering a [batch, kvh, len, d] view once per layer and running two batched matmuls
    # beats a per-sequence loop by far on the CPU.
    keys = k_cache[block_tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)    # [B, kvh, L, d]
    values = v_cache[block_tables].view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2)  # [B, kvh, L, d]
    q = query.view(batch, num_kv_heads, group, head_dim)                                            # [B, kvh, g, d]
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale                                          # [B, kvh, g, L]
    padding = torch.arange(max_len, device=query.device)[None, :] >= context_lens[:, None]           # [B, L]
    scores.masked_fill_(padding[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)                             # [B, H, d]


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """New tokens of each sequence attending causally to the sequence's paged context.
    The new tokens are the last q_len of each context (their K/V already stored).
    query [num_tokens, num_heads, head_dim], cu_seqlens_q [num_seqs + 1], context_lens [num_seqs]."""
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        keys = gather_context(k_cache, block_tables[i], context_len).transpose(0, 1)    # [kvh, ctx, d]
        values = gather_context(v_cache, block_tables[i], context_len).transpose(0, 1)  # [kvh, ctx, d]
        q = query[q_start:q_end].transpose(0, 1)                                        # [H, q_len, d]
        if q_len == context_len:
            mask, causal = None, True
        else:
            query_pos = torch.arange(context_len - q_len, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]  # [q_len, ctx]
            causal = False
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=True)                # [H, q_len, d]
        out[q_start:q_end] = o.transpose(0, 1)
    return out
