"""A sequence's KV blocks out of one paged cache and into another: what a KV transfer moves.

A frame is laid out as the cache, [num_layers, num_blocks, block_size, 2, kv_heads, head_dim], with the transfer's
blocks: one copy out (which ZeroMQ sends without copying), one copy in. A transfer goes in layer groups, one message
each, so that the copies overlap the wire.
"""

import numpy as np
import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_GROUPS = 6  # messages per transfer: enough to overlap the copies with the wire, few enough to stay cheap


def layer_groups(num_layers: int, num_groups: int = LAYER_GROUPS) -> list[tuple[int, int]]:
    """[start, end) of each group of layers, in order."""
    size = -(-num_layers // max(1, min(num_groups, num_layers)))
    return [(lo, min(num_layers, lo + size)) for lo in range(0, num_layers, size)]


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int], layers: tuple[int, int] | None = None) -> torch.Tensor:
    """K and V of these blocks in these layers (default all), contiguous on the CPU: a frame, ready to go out."""
    lo, hi = layers or (0, kv_cache.shape[0])
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    # index_select, not kv_cache[:, index]: advanced indexing of the cache is markedly slower on the CPU.
    return kv_cache[lo:hi].index_select(1, index).cpu()


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor, layers: tuple[int, int] | None = None
) -> None:
    """Place received K and V ([num_layers, len(block_ids), block_size, 2, ...]) into these blocks of these layers."""
    lo, hi = layers or (0, kv_cache.shape[0])
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    kv_cache[lo:hi].index_copy_(1, index, wait_copied(kv).to(kv_cache.device, kv_cache.dtype))


class PendingFrame:
    """A frame a device copy may still be writing (kv_gather.py); who sends it waits for it, off the step loop."""

    def __init__(self, array: np.ndarray, copied):
        self.array, self.copied = array, copied  # copied: the copy's torch.cuda.Event
        self.nbytes = array.nbytes

    def wait(self) -> np.ndarray:
        self.copied.synchronize()
        return self.array


def wait_copied(kv: torch.Tensor) -> torch.Tensor:
    """kv, once the device-to-host copy that fills it (if any) has run."""
    copied = getattr(kv, "copied", None)
    if copied is not None:
        copied.synchronize()
    return kv


def as_frames(kv: torch.Tensor) -> list:
    """The raw bytes of gathered K and V, viewed, not copied; a PendingFrame while a device copy fills them."""
    frame = kv.view(-1).view(torch.uint8).numpy()
    copied = getattr(kv, "copied", None)
    return [frame if copied is None else PendingFrame(frame, copied)]


def ready_frames(frames: list) -> list:
    """frames with each PendingFrame waited for: what can go on the wire."""
    return [f.wait() if isinstance(f, PendingFrame) else f for f in frames]


def frame_tensor(frame, dtype: str, shape: list[int]) -> torch.Tensor:
    """A received frame as a tensor over the same memory (no copy)."""
    raw = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=np.uint8)
    return torch.from_numpy(raw).view(TORCH_DTYPES[dtype]).view(shape)
