"""Copying a sequence's KV blocks out of a CUDA cache without stopping the host: a plain `.cpu()` would wait for
every kernel queued before it (the rest of the step's layers, from the layer hook). The gather and copy run on a side
stream, after an event marking where the compute stood, into pinned memory. The host tensor comes back at once with
the copy's event as `copied`; the KV sender's thread waits for it before the bytes go out (kv_blocks.PendingFrame).
"""

import torch


class DeviceGather:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def gather(self, kv_cache: torch.Tensor, block_ids: list[int], layers: tuple[int, int]) -> torch.Tensor:
        """As kv_blocks.gather_blocks, into pinned memory that the copy may still be filling (see `copied`)."""
        lo, hi = layers
        stored = torch.cuda.Event()
        stored.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(stored)
            # Made and freed on this stream: the allocator hands their memory on to later work of this stream only.
            index = torch.tensor(block_ids, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
            gathered = kv_cache[lo:hi].index_select(1, index)
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)  # the pinned allocator keeps `host` until this has run
            copied = torch.cuda.Event()
            copied.record(self.stream)
        host.copied = copied
        return host
