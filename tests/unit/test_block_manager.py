import pytest

from kvferry.common.block_manager import BlockManager


def test_allocate_free_and_reuse():
    bm = BlockManager(num_blocks=4, block_size=8)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(2)
    with pytest.raises(RuntimeError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 4 and all(c == 0 for c in bm.ref_counts)


def test_shared_block_returns_to_pool_only_after_last_reference():
    bm = BlockManager(num_blocks=2, block_size=4)
    [b] = bm.allocate(1)
    bm.share([b])
    bm.free([b])
    assert bm.num_free_blocks == 1 and bm.ref_counts[b] == 1
    bm.free([b])
    assert bm.num_free_blocks == 2


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(AssertionError):
        bm.free(ids)


@pytest.mark.parametrize("num_tokens,expected", [(0, 0), (1, 1), (8, 1), (9, 2), (17, 3)])
def test_grow_allocates_just_enough_blocks(num_tokens, expected):
    bm = BlockManager(num_blocks=8, block_size=8)
    table = []
    bm.grow(table, num_tokens)
    assert len(table) == expected
    # Waste is under one block: the last block holds at least one token.
    assert len(table) * 8 - num_tokens < 8
    bm.grow(table, num_tokens)  # idempotent
    assert len(table) == expected


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
