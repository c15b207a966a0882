"""Triton: write each new token's K and V into its cache slot."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_value_t,
    stride_slot,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    # A negative slot marks a padding token (CUDA-graph batches): nothing to store.
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        mask = offs < ROW
        k = tl.load(key_ptr + token * stride_key_t + offs, mask=mask)
        v = tl.load(value_ptr + token * stride_value_t + offs, mask=mask)
        tl.store(k_cache_ptr + slot.to(tl.int64) * stride_slot + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot.to(tl.int64) * stride_slot + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and slot_mapping.shape == (num_tokens,)
    # Slots are evenly spaced (the runner's caches are K and V halves of one tensor, so a slot's stride may be
    # twice its row) and each slot's heads are one dense row.
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    assert k_cache.stride(2) == head_dim and k_cache.stride(3) == 1
    # Each token's heads must be one dense row so that a flat offset addresses them.
    assert key.stride(2) == 1 and key.stride(1) == head_dim and value.stride(2) == 1 and value.stride(1) == head_dim
    row = num_kv_heads * head_dim
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        k_cache.stride(1),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )
