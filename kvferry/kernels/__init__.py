"""Paged-attention operations, dispatched by device: Triton on CUDA; on the CPU, decode and prefill attention in C
where kernels/cpu has been enabled and takes the tensors, else the PyTorch reference."""

import torch

from kvferry.kernels import reference
from kvferry.kernels.cpu import decode_attention as cpu_decode
from kvferry.kernels.cpu import prefill_attention as cpu_prefill


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.is_cuda:
        from kvferry.kernels.triton.store_kv import store_kv as impl
    else:
        impl = reference.store_kv
    impl(key, value, k_cache, v_cache, slot_mapping)


def needs_decode_plan(query, k_cache, v_cache) -> bool:
    """Whether decode attention runs on the reference, which wants reference.plan_decode's plan for the step."""
    return not query.is_cuda and not cpu_decode.handles(query, k_cache, v_cache)


def paged_decode_attention(
    query, k_cache, v_cache, block_tables, context_lens, scale, reference_plan=None, new=None
) -> torch.Tensor:
    """reference_plan: reference.plan_decode's result, built once per step and shared by the layers. new: (key,
    value, slot_mapping) of the step's tokens, stored into the cache first (by the C kernel, in the same call)."""
    if cpu_decode.handles(query, k_cache, v_cache):
        return cpu_decode.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, new)
    if new is not None:
        store_kv(new[0], new[1], k_cache, v_cache, new[2])
    if query.is_cuda:
        from kvferry.kernels.triton.decode_attention import paged_decode_attention as impl

        return impl(query, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, scale, plan=reference_plan
    )


def paged_prefill_attention(
    query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len: int | None = None
) -> torch.Tensor:
    """max_q_len: the longest new-token run, known on the host; saves the kernel a device sync per layer."""
    if query.is_cuda:
        from kvferry.kernels.triton.prefill_attention import paged_prefill_attention as impl

        return impl(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, max_q_len=max_q_len)
    if cpu_prefill.handles(query, k_cache, v_cache):
        return cpu_prefill.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
        )
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
