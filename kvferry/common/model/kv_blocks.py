"""A sequence's KV blocks out of one paged cache and into another: what a KV transfer moves.

Caches are [num_layers, num_blocks, block_size, kv_heads, head_dim]. Out: one copy into a contiguous
CPU buffer (the gather), which ZeroMQ then sends without copying. In: the received frames are viewed
as tensors in place and copied once, straight into the receiver's blocks.
"""
import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of these blocks, each [num_layers, len(block_ids), block_size, kv_heads, head_dim], contiguous on
    the CPU: ready to go out as raw frames."""
    index = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
    # index_select, not k_cache[:, index]: advanced indexing of the 5-D cache is markedly slower on the CPU.
    return k_cache.index_select(1, index).cpu(), v_cache.index_select(1, index).cpu()


def scatter_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: list[int], keys: torch.Tensor,
                   values: torch.Tensor) -> None:
    """Place received K and V ([num_layers, len(block_ids), ...]) into these blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=k_cache.device)
    k_cache[:, index] = keys.to(k_cache.device, k_cache.dtype)
    v_cache[:, index] = values.to(v_cache.device, v_cache.dtype)


def as_frames(keys: torch.Tensor, values: torch.Tensor) -> list:
    """The raw bytes of gathered K and V, viewed (not copied) so that ZeroMQ sends them in place."""
    return [keys.view(-1).view(torch.uint8).numpy(), values.view(-1).view(torch.uint8).numpy()]


def frame_tensor(frame, dtype: str, shape: list[int]) -> torch.Tensor:
    """A received frame as a tensor over the same memory (no copy)."""
    raw = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
    return torch.from_numpy(raw).view(TORCH_DTYPES[dtype]).view(shape)
