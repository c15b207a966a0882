"""The KV block pool: integer block ids, reference counts and a free list.

Pure Python on purpose: the scheduler plans with it, and the model runner is the only
place that turns block ids into tensor slots. Sharing (prefix reuse, parallel sampling)
is a matter of ref counts, so it is built in from the start.
"""
from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # FIFO reuse keeps freshly freed blocks cold a little longer, which later helps prefix caching.
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free_ids)

    def allocate(self, num_new_blocks: int) -> list[int]:
        if not self.can_allocate(num_new_blocks):
            raise RuntimeError(f"asked for {num_new_blocks} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(num_new_blocks)]
        for block_id in ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} reused while referenced"
            self.ref_counts[block_id] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} shared while free"
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        # Reverse order: the tail of a sequence goes back first, so a later allocation
        # of the same length gets the same ids in the same order.
        for block_id in reversed(block_ids):
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_ids.append(block_id)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place so that it holds num_tokens tokens."""
        block_table.extend(self.allocate(self.blocks_needed(block_table, num_tokens)))
