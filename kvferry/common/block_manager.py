"""The KV block pool: integer block ids, reference counts, a free list, and the prefix cache.

Pure Python on purpose: the scheduler plans with it, and the model runner is the only place that turns block ids
into tensor slots. Sharing (prefix reuse, parallel sampling) is a matter of ref counts.

Prefix caching: a full block whose KV is computed can be registered under its chained content hash (block_hash.py).
When its last reference goes, it stays in the free list with its contents and hash, so a later prompt with the same
prefix takes it back instead of recomputing it. The free list is in LRU order; allocation takes the oldest free block
and only then forgets the hash it held (eviction).
"""

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        # Oldest first. FIFO reuse keeps freshly freed blocks (and their cached prefixes) around longest.
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # content hash -> block id holding that KV
        self.hash_of: dict[int, bytes] = {}  # and back
        self._changed: dict[bytes, None] = {}  # hashes stored or evicted since take_cache_events (ordered)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cacheable_blocks(self, num_tokens: int) -> int:
        """Full blocks before the one holding the last of num_tokens: those a prompt may take from a cache. The
        last token is always computed (its logits give the next token)."""
        return (num_tokens - 1) // self.block_size

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free_ids)

    def allocate(self, num_new_blocks: int) -> list[int]:
        if not self.can_allocate(num_new_blocks):
            raise RuntimeError(f"asked for {num_new_blocks} blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popitem(last=False)[0] for _ in range(num_new_blocks)]
        for block_id in ids:
            assert self.ref_counts[block_id] == 0, f"block {block_id} reused while referenced"
            self.ref_counts[block_id] = 1
            self._evict(block_id)
        return ids

    def share(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} shared while free"
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        # Reverse order: the tail of a sequence goes back first, so a later allocation of the same length
        # gets the same ids in the same order, and a cached prefix's first blocks are evicted last.
        for block_id in reversed(block_ids):
            assert self.ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_ids[block_id] = None

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a table needs to hold num_tokens tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(block_table))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place so that it holds num_tokens tokens."""
        block_table.extend(self.allocate(self.blocks_needed(block_table, num_tokens)))

    # -- the prefix cache ---------------------------------------------------------------------------------
    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Block ids holding the longest cached run of these chained hashes, from the first."""
        found = []
        if self.enable_caching:
            for h in hashes:
                block_id = self.cached.get(h)
                if block_id is None:
                    break
                found.append(block_id)
        return found

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these (cached) blocks sit in the free list: taking them uses up free blocks too."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def take_cached(self, block_ids: list[int]) -> None:
        """Reference cached blocks (from match_prefix) for a new sequence."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_ids[block_id]
            self.ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """A held, full block's KV is now computed: later prompts with the same prefix may reuse it. When the
        hash is cached already (two sequences computed the same prefix at once), the older copy stays."""
        assert self.ref_counts[block_id] > 0, f"block {block_id} registered while free"
        if not self.enable_caching or block_hash in self.cached or block_id in self.hash_of:
            return
        self.cached[block_hash] = block_id
        self.hash_of[block_id] = block_hash
        self._changed[block_hash] = None

    def _evict(self, block_id: int) -> None:
        block_hash = self.hash_of.pop(block_id, None)
        if block_hash is not None:
            del self.cached[block_hash]
            self._changed[block_hash] = None

    def take_cache_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) since the last call, net: what a router's copy of this cache needs to catch up."""
        stored = [h for h in self._changed if h in self.cached]
        evicted = [h for h in self._changed if h not in self.cached]
        self._changed = {}
        return stored, evicted
