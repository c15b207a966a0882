"""Prefix caching: chained block hashes, the LRU pool that keeps freed blocks' KV, and the scheduler reusing it."""

import subprocess
import sys

import pytest

from kvferry.common.block_hash import block_hashes, hash_block
from kvferry.common.block_manager import BlockManager
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import Sequence
from tests.unit.test_scheduler import FakeRunner, check_accounting, make, step

TOKENS = list(range(1000, 1040))


def test_hashes_are_the_same_in_another_process():
    code = (
        "from kvferry.common.block_hash import block_hashes; "
        f"print(','.join(h.hex() for h in block_hashes({TOKENS!r}, 16)))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    assert other.split(",") == [h.hex() for h in block_hashes(TOKENS, 16)]


def test_a_differing_token_changes_that_block_and_every_later_hash():
    base = block_hashes(TOKENS, 8)
    assert len(base) == 5 and len(set(base)) == 5
    for position in (0, 7, 8, 20, 39):
        changed = list(TOKENS)
        changed[position] += 1
        hashes = block_hashes(changed, 8)
        first = position // 8
        assert hashes[:first] == base[:first]
        assert all(a != b for a, b in zip(hashes[first:], base[first:]))
    # The chain, not only the block's tokens: the same 8 tokens after another prefix hash differently.
    assert hash_block(base[0], TOKENS[8:16]) != hash_block(base[1], TOKENS[8:16])
    assert block_hashes(TOKENS[:20], 8) == base[:2]  # only full blocks
    assert block_hashes(TOKENS, 8, start=base[:3]) == base  # extends from known hashes


def test_freed_cached_blocks_are_reused_until_evicted_oldest_first():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    ha, hb = block_hashes([1, 2, 3, 4], 2)
    bm.register(a[0], ha)
    bm.register(a[1], hb)
    assert bm.take_cache_events() == ([ha, hb], []) and bm.take_cache_events() == ([], [])
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.match_prefix([ha, hb]) == a
    bm.take_cached(a[:1])  # a hit takes a free block out of the free list
    assert bm.num_free_blocks == 3 and bm.ref_counts[a[0]] == 1
    bm.free(a[:1])
    # Two never-used blocks go first, then the least recently freed cached one: a[1] (freed before a[0]).
    fresh = bm.allocate(3)
    assert set(fresh[:2]).isdisjoint(a) and fresh[2] == a[1]
    assert bm.match_prefix([ha, hb]) == [a[0]] and bm.take_cache_events() == ([], [hb])
    bm.free(fresh)
    assert bm.num_cached_blocks == 1 and not any(bm.ref_counts)


def test_a_hash_computed_twice_keeps_the_first_block():
    bm = BlockManager(4, 2)
    x, y = bm.allocate(2)
    [h] = block_hashes([5, 6], 2)
    bm.register(x, h)
    bm.register(y, h)
    assert bm.cached == {h: x} and bm.hash_of == {x: h}
    with pytest.raises(AssertionError):
        bm.register(3, h)  # block 3 is free: nothing computed it


def run_to_end(sch, runner):
    while sch.has_unfinished:
        step(sch, runner)
        check_accounting(sch)


def prompt_seq(name, tokens, **params):
    return Sequence(name, list(tokens), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, **params))


@pytest.mark.parametrize("shared_len", [3, 4, 5, 7, 8, 9, 12, 16])
def test_a_later_prompt_computes_only_what_is_not_cached(shared_len):
    """Prefixes of every length around the block boundaries (block size 4); the fake runner checks every KV
    read, so a block reused wrongly fails the step."""
    sch = make(num_blocks=16, block_size=4)
    runner = FakeRunner(sch)
    first = prompt_seq("first", range(1, 17))
    sch.add(first)
    run_to_end(sch, runner)
    computed = sch.num_computed_prompt_tokens
    second = prompt_seq("second", list(range(1, shared_len + 1)) + [99, 98, 97])
    sch.add(second)
    run_to_end(sch, runner)
    reusable = min(shared_len, second.num_tokens - 1 - 2) // 4 * 4  # full blocks, never the last prompt token's
    assert second.num_cached_tokens == reusable
    assert sch.num_computed_prompt_tokens - computed == second.num_tokens - 2 - reusable
    assert sch.block_manager.num_free_blocks == 16


def test_an_identical_prompt_recomputes_only_its_last_block():
    sch = make(num_blocks=16, block_size=4)
    runner = FakeRunner(sch)
    for name in ("a", "b"):
        sch.add(prompt_seq(name, range(1, 13)))
        run_to_end(sch, runner)
    assert sch.num_cached_prompt_tokens == 8 and sch.num_computed_prompt_tokens == 12 + 4


def test_without_caching_or_with_prompt_logprobs_everything_is_computed():
    for sch, params in ((make(caching=False), {}), (make(), {"prompt_logprobs": 1})):
        runner = FakeRunner(sch)
        for name in ("a", "b"):
            sch.add(prompt_seq(name, range(1, 13), **params))
            run_to_end(sch, runner)
        assert sch.num_cached_prompt_tokens == 0 and sch.num_computed_prompt_tokens == 24


def test_prompts_arriving_together_compute_a_shared_prefix_once():
    sch = make(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(sch)
    for i in range(4):
        sch.add(prompt_seq(f"s{i}", list(range(1, 17)) + [100 + i]))
    plan, _ = step(sch, runner)
    assert [c.seq.request_id for c in plan.chunks] == ["s0"]  # the others wait one step for its blocks
    plan, _ = step(sch, runner)
    assert [c.num_new_tokens for c in plan.chunks] == [1, 1, 1]
    run_to_end(sch, runner)
    assert sch.num_computed_prompt_tokens == 17 + 3 and sch.num_cached_prompt_tokens == 48


def test_cached_blocks_count_as_free_and_pressure_evicts_them():
    sch = make(num_blocks=8, block_size=4, max_model_len=32)
    runner = FakeRunner(sch)
    sch.add(prompt_seq("a", range(1, 25)))  # 6 blocks, 6 cached after
    run_to_end(sch, runner)
    assert sch.block_manager.num_free_blocks == 8 and sch.block_manager.num_cached_blocks == 6
    sch.add(prompt_seq("b", range(500, 528)))  # needs 7 of the 8 blocks: evicts 5 of a's
    run_to_end(sch, runner)
    sch.add(prompt_seq("a2", range(1, 25)))  # whatever of a survived is reused, the rest recomputed
    run_to_end(sch, runner)
    assert sch.block_manager.num_free_blocks == 8


def test_queued_prompt_tokens_leave_out_what_the_cache_holds():
    """The gateway balances prefill workers on this figure: a queue of prompts sharing a cached prefix is light."""
    sch = make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner(sch)
    sch.add(prompt_seq("warm", range(1, 18)))
    run_to_end(sch, runner)
    for i in range(3):
        sch.add(prompt_seq(f"q{i}", list(range(1, 17)) + [100 + i, 200 + i]))  # 16 cached, 2 to compute
    sch.add(prompt_seq("cold", range(500, 510)))
    assert sch.queued_prompt_tokens() == 3 * 2 + 10
    plan, _ = step(sch, runner)  # budget 8: q0..q2 take 6, cold starts with 2 of its 10
    assert plan.num_tokens == 8 and sch.queued_prompt_tokens() == 8
    assert make(caching=False).queued_prompt_tokens() == 0
