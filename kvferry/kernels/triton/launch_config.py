"""Launch settings of the attention kernels, from shapes and the device only: tests check them without a GPU, and
a decode step captured in a CUDA graph picks the same settings on every replay.
"""

import functools
from dataclasses import dataclass

import torch

MIN_DOT = 16  # tl.dot needs every dimension to be at least 16
# Used where the device cannot be asked (the interpreter, or a torch without the field): the opt-in limit of
# sm_86 and sm_89, the smallest among the GPUs since Ampere, so that the tiles fit on any of them.
FALLBACK_SHARED_MEMORY = 99 * 1024
# Values of one tile held per thread: past this, registers spill. fp32 dots run on the FMA units, which keep more
# of each operand in registers than a tensor-core dot does.
TILE_PER_THREAD = 32
TILE_PER_THREAD_FP32 = 16
# Decode: a split-KV program must read enough keys to repay its partial results' write and their reduction.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
FALLBACK_TARGET_PROGRAMS = 128


@dataclass(frozen=True)
class Tiles:
    block_m: int  # query rows per program: prefill tokens, or decode's padded GQA group
    block_n: int  # keys per step of the loop over the context
    num_warps: int
    num_stages: int


def shared_bytes(tiles: Tiles, head_dim_pad: int, elem_bytes: int) -> int:
    """Shared memory of one program, estimated as the query tile plus num_stages K and V tiles in flight."""
    return elem_bytes * head_dim_pad * (tiles.block_m + 2 * tiles.num_stages * tiles.block_n)


def attention_tiles(
    block_m: int, block_n: int, head_dim_pad: int, elem_bytes: int, budget: int, shrink_m: bool
) -> Tiles:
    """The largest tiles, from the given ones down, whose shared memory fits the budget and whose largest tile
    (Q or the accumulator, K or V, the scores) spreads over 4 or 8 warps without spilling. The larger of
    block_m and block_n is halved first (block_n on a tie: a query tile is reused over the whole loop, a key
    tile only once); block_m only when shrink_m."""
    per_thread = TILE_PER_THREAD_FP32 if elem_bytes == 4 else TILE_PER_THREAD
    while True:
        largest_tile = max(block_m, block_n) * max(head_dim_pad, min(block_m, block_n))
        for num_warps in (4, 8):
            for num_stages in (2, 1):
                tiles = Tiles(block_m, block_n, num_warps, num_stages)
                if (
                    shared_bytes(tiles, head_dim_pad, elem_bytes) <= budget
                    and largest_tile <= num_warps * 32 * per_thread
                ):
                    return tiles
        if shrink_m and block_m > block_n:
            block_m //= 2
        elif block_n > MIN_DOT:
            block_n //= 2
        elif shrink_m and block_m > MIN_DOT:
            block_m //= 2
        else:  # nothing smaller to try
            return Tiles(block_m, block_n, 8, 1)


def prefill_tiles(head_dim_pad: int, elem_bytes: int, budget: int) -> Tiles:
    return attention_tiles(64, 64, head_dim_pad, elem_bytes, budget, shrink_m=True)


def decode_tiles(group_pad: int, head_dim_pad: int, elem_bytes: int, budget: int) -> Tiles:
    """block_m is the padded GQA group: every query head of the group shares each K and V tile."""
    return attention_tiles(group_pad, 64, head_dim_pad, elem_bytes, budget, shrink_m=False)


def decode_splits(batch: int, num_kv_heads: int, max_context: int, target_programs: int) -> int:
    """How many parts each sequence's context is cut into (flash-decoding). One when batch * kv heads already
    fills the device or contexts are short; otherwise enough to reach target_programs, with at least
    MIN_SPLIT_TOKENS keys a part. max_context is an upper bound known from shapes (a block table's width)."""
    programs = batch * num_kv_heads
    if programs >= target_programs:
        return 1
    by_occupancy = -(-target_programs // programs)
    by_length = max_context // MIN_SPLIT_TOKENS
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def dot_precision(dtype: torch.dtype) -> str:
    """ieee keeps an fp32 model's dots exact instead of tf32; it does not matter for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def shared_memory_budget(device: torch.device) -> int:
    """Three quarters of the device's per-program limit: Triton needs the rest for its own layout changes."""
    limit = FALLBACK_SHARED_MEMORY
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = getattr(_cuda_properties(index), "shared_memory_per_block_optin", FALLBACK_SHARED_MEMORY)
    return limit * 3 // 4


def target_programs(device: torch.device) -> int:
    """Two programs per SM, so that one waiting on memory leaves another to run."""
    if device.type != "cuda":
        return FALLBACK_TARGET_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return 2 * _cuda_properties(index).multi_processor_count
