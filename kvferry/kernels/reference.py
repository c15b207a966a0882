"""PyTorch versions of the paged-attention operations: the CPU's fallback, and the oracle the kernels are tested
against. Cache layout, per layer: [num_blocks, block_size, num_kv_heads, head_dim] for K and for V, two tensors or
(the runner's) the halves of one [num_blocks, block_size, 2, kvh, d]. Block table entries past a context are padding.
The cache's type may differ from the query's (an fp16 cache beside an fp32 model): K and V are stored in the cache's
type and read back in the query's.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's K/V into its slot; a negative slot (a decode graph's padding) stores nothing."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    if slot_mapping.numel() and slot_mapping.min() < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)  # [num_slots, kvh, d]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's cached K or V as a contiguous [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:context_len]


# K and V bytes gathered per decode pass: small enough to be in the last-level cache when SDPA reads it, large
# enough to keep op counts low (docs/benchmarks.md, "Decode pass size").
DECODE_GATHER_BYTES = 8 * 2**20


@dataclass
class DecodeChunk:
    start: int
    end: int
    rows: torch.Tensor  # [n * num_blocks] int64 block ids, flattened
    longest: int  # the chunk's longest context
    mask: torch.Tensor | None  # [n, 1, 1, longest] visible keys; None when all lengths are equal


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor) -> list[DecodeChunk]:
    """The per-step half of decode attention, built once for every layer: consecutive sequences share a pass while
    their blocks' K and V (padded to the pass's longest context) fit in DECODE_GATHER_BYTES."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_bytes = 2 * block_size * num_kv_heads * head_dim * k_cache.element_size()
    lens = context_lens.tolist()
    chunks, start = [], 0
    while start < len(lens):
        end, longest = start + 1, lens[start]
        while end < len(lens):
            wider = max(longest, lens[end])
            if (end + 1 - start) * -(-wider // block_size) * block_bytes > DECODE_GATHER_BYTES:
                break
            end, longest = end + 1, wider
        rows = block_tables[start:end, : -(-longest // block_size)].flatten().long()
        mask = None
        if min(lens[start:end]) < longest:
            positions = torch.arange(longest, device=context_lens.device)
            mask = (positions[None, :] < context_lens[start:end, None])[:, None, None, :]
        chunks.append(DecodeChunk(start, end, rows, longest, mask))
        start = end
    return chunks


def interleaved_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """When k_cache and v_cache are the halves of one [num_blocks, block_size, 2, kvh, d] tensor (the runner's
    layout), each block's K and V as one row [num_blocks, block_size * 2 * kvh * d]; otherwise None."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    row = num_kv_heads * head_dim
    if (
        k_cache.stride() != (block_size * 2 * row, 2 * row, head_dim, 1)
        or v_cache.stride() != k_cache.stride()
        or v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr()
        or v_cache.storage_offset() != k_cache.storage_offset() + row
    ):
        return None
    return k_cache.as_strided((num_blocks, block_size * 2 * row), (block_size * 2 * row, 1))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: list[DecodeChunk] | None = None,
) -> torch.Tensor:
    """query [batch, num_heads, head_dim], one new token per sequence, attending to its whole cached context."""
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    both = interleaved_blocks(k_cache, v_cache)
    if both is None:
        k_rows, v_rows = k_cache.reshape(num_blocks, -1), v_cache.reshape(num_blocks, -1)  # one block per row
    out = torch.empty_like(query)
    for c in plan or plan_decode(block_tables, context_lens, k_cache):
        # index_select of whole blocks is far cheaper than advanced indexing; SDPA reads the views in place.
        n = c.end - c.start
        if both is not None:  # one copy of whole blocks brings K and V: fewer, longer runs of memory
            kv = both.index_select(0, c.rows).view(n, -1, 2, num_kv_heads, head_dim)
            kv = kv[:, : c.longest]  # [n, len, 2, kvh, d]
            keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [n, kvh, len, d]
        else:
            shape = (n, -1, num_kv_heads, head_dim)
            keys = k_rows.index_select(0, c.rows).view(shape)[:, : c.longest].transpose(1, 2)  # [n, kvh, len, d]
            values = v_rows.index_select(0, c.rows).view(shape)[:, : c.longest].transpose(1, 2)  # [n, kvh, len, d]
        keys, values = keys.to(query.dtype), values.to(query.dtype)
        out[c.start : c.end] = F.scaled_dot_product_attention(
            query[c.start : c.end, :, None, :], keys, values, attn_mask=c.mask, scale=scale, enable_gqa=True
        )[:, :, 0, :]  # [n, H, d]
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], each sequence's new tokens (the last of its context, their K/V
    stored), attending causally to its paged context."""
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        keys = gather_context(k_cache, block_tables[i], context_len).transpose(0, 1).to(query.dtype)  # [kvh, ctx, d]
        values = gather_context(v_cache, block_tables[i], context_len).transpose(0, 1).to(query.dtype)
        q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, d]
        if q_len == context_len:
            mask, causal = None, True
        else:
            query_pos = torch.arange(context_len - q_len, context_len, device=query.device)
            mask = torch.arange(context_len, device=query.device)[None, :] <= query_pos[:, None]  # [q_len, ctx]
            causal = False
        # With a batch dimension the CPU takes its flash kernel; 3-D inputs fall back to the math path, which
        # materialises every score and is far slower on long prompts (docs/benchmarks.md, "Chunked prefill").
        o = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )[0]  # [H, q_len, d]
        out[q_start:q_end] = o.transpose(0, 1)
    return out
