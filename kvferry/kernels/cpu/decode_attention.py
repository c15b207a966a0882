"""Paged decode attention on the CPU by the C kernel in decode_attention.c, which reads K and V from their blocks
in place: once through memory, where the reference's gather and SDPA take about three. The cache may be fp32, fp16
or bf16 (one entry point each); the query and output are fp32."""

import ctypes
from pathlib import Path

import torch

from kvferry.kernels.cpu import build

SOURCE = Path(__file__).with_suffix(".c")
pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
ARGTYPES = [pointer, pointer, size, pointer, size, pointer, pointer, pointer, size, size, size]
ARGTYPES += [pointer, size, pointer, pointer] + [count] * 5 + [ctypes.c_float, count]
# The C name of each KV cache type, and its bit in kvferry_kv_types (vectors.h's kv_type)
KV_TYPES = {torch.float32: ("f32", 0), torch.float16: ("f16", 1), torch.bfloat16: ("bf16", 2)}
SIGNATURES = {f"kvferry_paged_decode_attention_{name}": (ARGTYPES, ctypes.c_int) for name, _ in KV_TYPES.values()}
SIGNATURES["kvferry_kv_types"] = ([], ctypes.c_int)
_lib = build.Library(SOURCE, SIGNATURES, "the PyTorch reference for CPU decode attention")
enable, disable = _lib.enable, _lib.disable


def takes_kv_dtype(dtype: torch.dtype, lib: build.Library | None = None) -> bool:
    """Whether lib (default: this kernel's), loaded, reads a cache of this type (fp16 needs the CPU's conversions:
    F16C or AVX-512)."""
    lib = lib or _lib
    return lib.loaded is not None and dtype in KV_TYPES and bool(lib.kvferry_kv_types() >> KV_TYPES[dtype][1] & 1)


def entry_point(lib, prefix: str, dtype: torch.dtype):
    """lib's function prefix_<the C name of dtype>: the kernel's entry point for a cache of that type."""
    return getattr(lib, f"{prefix}_{KV_TYPES[dtype][0]}")


def handles(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel is loaded and takes these tensors (see layout_fits) and the cache's type."""
    return layout_fits(query, k_cache, v_cache) and takes_kv_dtype(k_cache.dtype)


def layout_fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What the C attention kernels take: an fp32 query on the CPU over a cache of one type (which takes_kv_dtype
    checks against the library), each token's heads laid out alike in K and V, every head's vector contiguous and a
    whole number of 16-element vectors, up to 256."""
    return (
        not query.is_cuda
        and query.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype
        and k_cache.device.type == "cpu"
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
        and k_cache.shape[-1] % 16 == 0  # whole vectors of 16 floats
        and k_cache.shape[-1] <= 256
        and k_cache.shape[2] * k_cache.stride(2) <= k_cache.stride(1)  # heads lie within their token's row
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """As reference.paged_decode_attention (context_lens at least 1). new: (key, value, slot_mapping), the step's K
    and V [batch, num_kv_heads, head_dim] (rows may be strided), stored first by the same call, as store_kv does."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    if batch == 0:
        return out
    key = value = slots = None
    if new is not None:
        key, value, slots = new
        if key.stride()[1:] != (head_dim, 1) or value.stride()[1:] != (head_dim, 1):
            key, value = key.contiguous(), value.contiguous()  # each token's heads one run of floats
        slots = slots.to(torch.int64).contiguous()
    failed = entry_point(_lib, "kvferry_paged_decode_attention", k_cache.dtype)(
        query.data_ptr(),
        None if key is None else key.data_ptr(), 0 if key is None else key.stride(0),
        None if value is None else value.data_ptr(), 0 if value is None else value.stride(0),
        None if slots is None else slots.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.stride()[:3],
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), out.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("CPU decode attention: no memory for its scores")
    return out
