"""A sequence's KV blocks out of one paged cache and into another: what a KV transfer moves.

The cache is [num_layers, num_blocks, block_size, 2, kv_heads, head_dim] (K and V of a token side by side);
on the wire K and V are a frame each, [num_layers, num_blocks, block_size, kv_heads, head_dim]. A transfer goes in layer groups,
one message each: the sender gathers a group (one copy into a contiguous CPU buffer, which ZeroMQ then
sends without copying) while the previous group is on the wire, and the receiver places each group,
viewed in place from the received frames, straight into its blocks while the next one arrives.
"""
import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_GROUPS = 6  # messages per transfer: enough to overlap the copies with the wire, few enough to stay cheap


def layer_groups(num_layers: int, num_groups: int = LAYER_GROUPS) -> list[tuple[int, int]]:
    """[start, end) of each group of layers, in order."""
    size = -(-num_layers // max(1, min(num_groups, num_layers)))
    return [(lo, min(num_layers, lo + size)) for lo in range(0, num_layers, size)]


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int],
                  layers: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of these blocks in these layers (default all), each [num_layers, len(block_ids), block_size,
    kv_heads, head_dim], contiguous on the CPU: ready to go out as raw frames."""
    lo, hi = layers or (0, kv_cache.shape[0])
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    # index_select of whole blocks, then K and V apart: index_select on the strided K view alone, or advanced
    # indexing, is hundreds of times slower on the CPU.
    both = kv_cache[lo:hi].index_select(1, index)  # [layers, n, block_size, 2, kvh, d]
    return both.select(3, 0).contiguous().cpu(), both.select(3, 1).contiguous().cpu()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor,
                   layers: tuple[int, int] | None = None) -> None:
    """Place received K and V ([num_layers, len(block_ids), ...]) into these blocks of these layers."""
    lo, hi = layers or (0, kv_cache.shape[0])
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache[lo:hi, :, :, 0][:, index] = keys.to(kv_cache.device, kv_cache.dtype)
    kv_cache[lo:hi, :, :, 1][:, index] = values.to(kv_cache.device, kv_cache.dtype)


def as_frames(keys: torch.Tensor, values: torch.Tensor) -> list:
    """The raw bytes of gathered K and V, viewed (not copied) so that ZeroMQ sends them in place."""
    return [keys.view(-1).view(torch.uint8).numpy(), values.view(-1).view(torch.uint8).numpy()]


def frame_tensor(frame, dtype: str, shape: list[int]) -> torch.Tensor:
    """A received frame as a tensor over the same memory (no copy)."""
    raw = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
    return torch.from_numpy(raw).view(TORCH_DTYPES[dtype]).view(shape)
