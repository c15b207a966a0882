"""Paged prefill attention on the CPU by the C kernel in prefill_attention.c, reading each context from its blocks
in place, 8 or 16 query rows at a time (vectors.h), where the reference gathers a copy per sequence. The cache may
be fp32, fp16 or bf16, as decode_attention.py's."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build
from kvferry.kernels.cpu.decode_attention import KV_TYPES, entry_point, layout_fits, takes_kv_dtype

SOURCE = Path(__file__).with_suffix(".c")
pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
ARGTYPES = [pointer, size, pointer, pointer, size, size, size, pointer, size, pointer, pointer, pointer]
ARGTYPES += [count] * 5 + [ctypes.c_float, count]
SIGNATURES = {f"kvferry_paged_prefill_attention_{name}": (ARGTYPES, ctypes.c_int) for name, _ in KV_TYPES.values()}
SIGNATURES["kvferry_kv_types"] = ([], ctypes.c_int)
_lib = build.Library(SOURCE, SIGNATURES, "the PyTorch reference for CPU prefill attention")
enable, disable = _lib.enable, _lib.disable


def handles(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        layout_fits(query, k_cache, v_cache)
        and takes_kv_dtype(k_cache.dtype, _lib)
        and query.stride()[1:] == (query.shape[2], 1)
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As reference.paged_prefill_attention; query's rows may be strided."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
    if num_tokens == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    starts = cu_seqlens_q.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    failed = entry_point(_lib, "kvferry_paged_prefill_attention", k_cache.dtype)(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), out.data_ptr(),
        len(lens), num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("CPU prefill attention: no memory for its scratch")
    return out
