"""The scheduler driven by a fake model runner: joins, leaves, budgets, preemption, and a property
test over random workloads with arrivals, finishes and aborts."""

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.common.block_manager import BlockManager
from kvferry.common.sampling import SamplingParams
from kvferry.common.scheduler import Scheduler
from kvferry.common.sequence import FinishReason, Sequence, SequenceStatus

EOS = 0


def make(
    num_blocks=16,
    block_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=64,
    caching=True,
    chunked=True,
    threshold=0,
):
    return Scheduler(
        BlockManager(num_blocks, block_size, caching),
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        eos_token_ids=(EOS,),
        enable_chunked_prefill=chunked,
        long_prefill_threshold=threshold,
    )


def seq(name, prompt_len, max_tokens=4, ignore_eos=True, first=1):
    """Prompts are first, first + 1, ...: with the same first token, any two share a prefix."""
    return Sequence(
        name,
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos),
    )


class FakeRunner:
    """Stands in for the model: checks what a real runner would need, and samples from a seeded rng.

    Its "KV cache" maps a slot to the tokens up to and including the one whose KV it holds (what real KV
    depends on). Every step checks that each sequence reads exactly its own tokens' KV, so a stale, evicted or
    overwritten block served from the prefix cache fails here."""

    def __init__(self, scheduler, seed=0, eos_rate=0.0):
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.eos_rate = eos_rate
        self.kv: dict[int, tuple] = {}

    def slot(self, s, position):
        bs = self.scheduler.block_manager.block_size
        return s.block_table[position // bs] * bs + position % bs

    def place(self, s):
        """A transfer's KV written into a prefilled sequence's blocks."""
        tokens = s.token_ids
        for position in range(s.num_computed_tokens):
            self.kv[self.slot(s, position)] = tuple(tokens[: position + 1])

    def execute(self, plan):
        bs = self.scheduler.block_manager.block_size
        # Over the budget only without chunking, and then alone: one prompt longer than the budget.
        assert plan.num_tokens <= self.scheduler.max_num_batched_tokens or (
            not self.scheduler.enable_chunked_prefill and len(plan.chunks) == 1
        )
        for chunk in plan.chunks:
            s = chunk.seq
            assert s.status == SequenceStatus.RUNNING and chunk.num_new_tokens >= 1
            # The blocks for every token computed in this step are there.
            assert len(s.block_table) * bs >= s.num_computed_tokens + chunk.num_new_tokens
            if not plan.is_prefill:
                assert chunk.num_new_tokens == 1 and s.num_uncomputed_tokens == 1
            tokens = s.token_ids
            for position in range(s.num_computed_tokens):
                assert self.kv.get(self.slot(s, position)) == tuple(tokens[: position + 1]), (
                    f"{s.request_id} reads wrong KV at position {position}"
                )
        for chunk in plan.chunks:  # written after every read: a step's reads never see its own writes' mix-ups
            s, tokens = chunk.seq, chunk.seq.token_ids
            for position in range(s.num_computed_tokens, s.num_computed_tokens + chunk.num_new_tokens):
                self.kv[self.slot(s, position)] = tuple(tokens[: position + 1])
        return [
            (EOS if self.rng.random() < self.eos_rate else self.rng.randrange(1, 100)) if c.samples else None
            for c in plan.chunks
        ]


def step(scheduler, runner):
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, runner.execute(plan))


def check_accounting(scheduler):
    bm = scheduler.block_manager
    # A block may sit in several tables (choices sharing a prompt): its ref count says exactly how many.
    holders = collections.Counter(b for s in scheduler.running for b in s.block_table)
    assert not set(holders) & set(bm.free_ids), "a block is both held and free"
    assert len(holders) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
    assert all(bm.ref_counts[b] == n for b, n in holders.items()), "a ref count differs from its holders"
    assert all(not s.block_table and s.num_computed_tokens == 0 for s in scheduler.waiting)
    for s in scheduler.running:
        # Never a block beyond the sequence's own tokens: the waste is under one block (the last one's tail).
        assert bm.num_blocks_for(s.num_computed_tokens) <= len(s.block_table) <= bm.num_blocks_for(s.num_tokens)
    assert len(scheduler.running) <= scheduler.max_num_seqs


def test_new_sequence_joins_at_next_step_and_finished_leaves_at_once():
    sch = make()
    runner = FakeRunner(sch)
    a = seq("a", 5, max_tokens=3)
    sch.add(a)
    plan, _ = step(sch, runner)
    assert plan.is_prefill and [c.seq for c in plan.chunks] == [a]
    plan, _ = step(sch, runner)
    assert not plan.is_prefill and [c.seq for c in plan.chunks] == [a]
    b = seq("b", 3, max_tokens=5)
    sch.add(b)
    plan, _ = step(sch, runner)  # b's prompt runs at once ...
    assert plan.is_prefill and [c.seq for c in plan.chunks] == [b]
    plan, finished = step(sch, runner)  # ... and b decodes with a at the next step, where a finishes
    assert [c.seq for c in plan.chunks] == [a, b]
    assert finished == [a] and a.finish_reason == FinishReason.LENGTH and len(a.output_token_ids) == 3
    assert sch.running == [b] and a.block_table == []
    plan, _ = step(sch, runner)
    assert [c.seq for c in plan.chunks] == [b]


def test_token_budget_chunks_long_prompts():
    sch = make(max_num_batched_tokens=8)
    runner = FakeRunner(sch)
    a, b = seq("a", 20), seq("b", 6, first=100)
    sch.add(a)
    sch.add(b)
    sizes = []
    while a.num_computed_tokens < 20 or b.num_computed_tokens < 6:
        plan, _ = step(sch, runner)
        assert plan.is_prefill
        sizes.append([(c.seq.request_id, c.num_new_tokens) for c in plan.chunks])
    assert sizes == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 4)], [("b", 2)]]
    assert len(a.output_token_ids) == 1 and len(b.output_token_ids) == 1


def test_a_long_prompt_is_capped_per_step_so_short_prompts_behind_it_start_at_once():
    sch = make(num_blocks=32, max_num_batched_tokens=16, max_model_len=128, threshold=6)
    runner = FakeRunner(sch)
    long = seq("long", 40)
    sch.add(long)
    plan, _ = step(sch, runner)
    assert [(c.seq.request_id, c.num_new_tokens) for c in plan.chunks] == [("long", 6)]  # capped, budget or not
    for name in ("s1", "s2", "s3"):
        sch.add(seq(name, 3, first=100))
    plan, _ = step(sch, runner)
    # The short prompts arrived while it ran: they finish their prefill beside its next chunk.
    assert [(c.seq.request_id, c.num_new_tokens) for c in plan.chunks] == [("long", 6), ("s1", 3), ("s2", 3), ("s3", 3)]
    assert all(len(c.seq.output_token_ids) == 1 for c in plan.chunks[1:]) and not long.output_token_ids
    sch.add(seq("s4", 14, first=200))  # longer than the cap, shorter than the budget: capped as well
    plan, _ = step(sch, runner)
    assert [(c.seq.request_id, c.num_new_tokens) for c in plan.chunks] == [("long", 6), ("s4", 6)]


def test_without_chunked_prefill_a_prompt_is_computed_in_one_step():
    sch = make(num_blocks=32, max_num_batched_tokens=8, max_model_len=128, chunked=False, threshold=2)
    runner = FakeRunner(sch)
    for name, length, first in (("long", 20, 1), ("a", 6, 100), ("b", 2, 200), ("c", 6, 300)):
        sch.add(seq(name, length, first=first))
    steps = []
    while any(s.num_uncomputed_tokens > 1 or not s.output_token_ids for s in sch.running + sch.waiting):
        plan, _ = step(sch, runner)
        steps.append([(c.seq.request_id, c.num_new_tokens) for c in plan.chunks])
    # Longer than the budget, the long prompt runs alone; then whole prompts while they fit, in arrival order.
    assert steps == [[("long", 20)], [("a", 6), ("b", 2)], [("c", 6)]]


def test_max_num_seqs_caps_the_running_batch():
    sch = make(max_num_seqs=2)
    runner = FakeRunner(sch)
    for i in range(3):
        sch.add(seq(f"s{i}", 2))
    step(sch, runner)
    assert [s.request_id for s in sch.running] == ["s0", "s1"] and len(sch.waiting) == 1


def test_preempts_newest_by_recompute_when_blocks_run_out():
    # 4 blocks of 4 tokens: two sequences of 7 tokens fill them; growing past 8 needs a fifth.
    sch = make(num_blocks=4, block_size=4, max_model_len=16)
    runner = FakeRunner(sch)
    old, new = seq("old", 7, max_tokens=6), seq("new", 7, max_tokens=6, first=100)
    sch.add(old)
    sch.add(new)
    step(sch, runner)  # both prompts; each samples its 8th token
    plan, _ = step(sch, runner)  # decode: both write token 8 into their second block, sample the 9th
    plan = sch.schedule()  # token 9 needs a third block each: only the newest is preempted
    assert plan.preempted == [new] and [c.seq for c in plan.chunks] == [old]
    assert new.status == SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert sch.waiting == [new] and new.num_preemptions == 1
    sch.update(plan, runner.execute(plan))
    check_accounting(sch)
    while sch.has_unfinished:
        step(sch, runner)
        check_accounting(sch)
    # The recomputed sequence kept its outputs and still got exactly max_tokens.
    assert len(new.output_token_ids) == 6 and len(old.output_token_ids) == 6
    assert sch.block_manager.num_free_blocks == 4


def test_abort_frees_blocks_anywhere():
    sch = make()
    runner = FakeRunner(sch)
    a, b = seq("a", 5), seq("b", 5)
    sch.add(a)
    step(sch, runner)
    sch.add(b)
    assert sch.abort("a") is a and a.finish_reason == FinishReason.ABORT
    assert sch.abort("b") is b and sch.abort("nope") is None
    assert not sch.has_unfinished and sch.block_manager.num_free_blocks == sch.block_manager.num_blocks


def test_eos_stops_unless_ignored_and_model_length_caps():
    sch = make(max_model_len=8)
    runner = FakeRunner(sch, eos_rate=1.0)
    stops, ignores = seq("stops", 3, max_tokens=10, ignore_eos=False), seq("ignores", 3, max_tokens=10)
    sch.add(stops)
    sch.add(ignores)
    while sch.has_unfinished:
        step(sch, runner)
    assert stops.finish_reason == FinishReason.STOP and stops.output_token_ids == [EOS]
    assert ignores.finish_reason == FinishReason.LENGTH and ignores.num_tokens == 8


def test_scheduler_is_deterministic():
    def run():
        sch = make(num_blocks=6, block_size=4, max_model_len=24)
        runner = FakeRunner(sch, seed=3, eos_rate=0.1)
        for i in range(6):
            sch.add(seq(f"s{i}", 3 + 2 * i, max_tokens=5 + i, ignore_eos=False))
        trace = []
        while sch.has_unfinished:
            plan, _ = step(sch, runner)
            trace.append(
                (
                    plan.is_prefill,
                    [(c.seq.request_id, c.num_new_tokens) for c in plan.chunks],
                    [s.request_id for s in plan.preempted],
                )
            )
        return trace

    assert run() == run()


@pytest.mark.parametrize("caching,chunked", [(True, True), (False, True), (True, False)])
@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 18),
    threshold=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_block_accounting_and_finish(
    caching, chunked, data, block_size, num_blocks, max_num_seqs, extra_budget, threshold, seed
):
    """With caching, prompts share prefixes of every length (most start at token 1) in a small pool: the fake
    runner's KV check catches any stale or evicted block served."""
    budget = max_num_seqs + extra_budget
    max_model_len = min(24, num_blocks * block_size)
    sch = make(num_blocks, block_size, max_num_seqs, budget, max_model_len, caching, chunked, threshold)
    runner = FakeRunner(sch, seed=seed, eos_rate=0.05)
    arrivals = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 30),
                st.integers(1, max_model_len - 1),
                st.integers(1, 12),
                st.booleans(),
                st.sampled_from([1, 1, 2, 50]),
            ),
            min_size=1,
            max_size=12,
        )
    )
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=4))
    seqs = []
    for t in range(400):
        for i, (at, plen, max_tokens, ignore_eos, first) in enumerate(arrivals):
            if at == t:
                s = seq(f"r{i}", plen, max_tokens, ignore_eos, first)
                seqs.append(s)
                sch.add(s)
        for at, idx in aborts:
            if at == t and idx < len(seqs):
                sch.abort(seqs[idx].request_id)
        if sch.has_unfinished:
            step(sch, runner)
        check_accounting(sch)
        if t > 30 and not sch.has_unfinished:
            break
    assert not sch.has_unfinished, "a request never finished"
    assert len(seqs) == len(arrivals)
    assert sch.block_manager.num_free_blocks == num_blocks, "blocks leaked"
    for s in seqs:
        assert s.is_finished
        assert s.finish_reason == FinishReason.ABORT or 1 <= len(s.output_token_ids) <= s.params.max_tokens
        assert s.num_tokens <= max_model_len


def test_settings_that_cannot_work_are_refused():
    from kvferry.common.errors import ConfigError

    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ConfigError, match="max_model_len=64"):
        make(num_blocks=2, block_size=4, max_model_len=64)


def test_prefill_worker_keeps_finished_blocks_until_released():
    sch = Scheduler(BlockManager(8, 4), 4, 32, 32, eos_token_ids=(EOS,), keep_finished_blocks=True)
    runner = FakeRunner(sch)
    s = seq("p", 6, max_tokens=1)
    sch.add(s)
    _, finished = step(sch, runner)
    assert finished == [s] and s.is_finished and len(s.block_table) == 2
    assert sch.block_manager.num_free_blocks == 6  # held for the transfer
    sch.release(s)
    assert sch.block_manager.num_free_blocks == 8 and s.block_table == []
    aborted = seq("a", 5)
    sch.add(aborted)
    sch.abort("a")
    assert sch.block_manager.num_free_blocks == 8  # an abort never holds blocks


def test_decode_worker_admits_a_prefilled_sequence_into_the_next_step():
    sch = make(num_blocks=8, block_size=4, max_model_len=32)
    runner = FakeRunner(sch)
    running = seq("r", 3, max_tokens=5)
    sch.add(running)
    step(sch, runner)
    arrived = seq("kv", 6, max_tokens=3)
    arrived.output_token_ids = [42]  # the first token, sampled by the prefill worker
    arrived.num_computed_tokens = 6
    assert sch.can_admit_prefilled(arrived.num_tokens)
    sch.admit_prefilled(arrived)
    runner.place(arrived)
    assert len(arrived.block_table) == 2
    plan, _ = step(sch, runner)
    assert not plan.is_prefill and [c.seq for c in plan.chunks] == [running, arrived]
    while sch.has_unfinished:
        step(sch, runner)
        check_accounting(sch)
    assert len(arrived.output_token_ids) == 3 and sch.block_manager.num_free_blocks == 8
    assert not sch.can_admit_prefilled(8 * 4 + 1)


def test_choices_share_their_prompts_full_blocks_on_admission():
    sch = make(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=3)
    bm = sch.block_manager
    # 6 prompt tokens + 1 first token: one full shared block, each choice one block of its own.
    assert sch.can_admit_prefilled(7, num_choices=3) and not sch.can_admit_prefilled(7, num_choices=4)
    assert sch.could_ever_admit_prefilled(7, 3) and not sch.could_ever_admit_prefilled(7, 4)  # max_num_seqs
    assert sch.could_ever_admit_prefilled(4 * 8, 1) and not sch.could_ever_admit_prefilled(4 * 8 + 1, 1)  # the pool
    first = seq("r#0", 6, max_tokens=3)
    first.output_token_ids, first.num_computed_tokens = [42], 6
    sch.admit_prefilled(first)
    runner = FakeRunner(sch)
    runner.place(first)
    others = []
    for i in (1, 2):
        other = seq(f"r#{i}", 6, max_tokens=3)
        other.output_token_ids, other.num_computed_tokens = [43], 6
        bm.share(first.block_table[:1])
        sch.admit_prefilled(other, first.block_table[:1])
        runner.place(other)
        others.append(other)
    assert all(o.block_table[0] == first.block_table[0] for o in others)
    assert len({first.block_table[1], *(o.block_table[1] for o in others)}) == 3
    assert bm.ref_counts[first.block_table[0]] == 3 and bm.num_free_blocks == 8 - 4
    while sch.has_unfinished:
        step(sch, runner)
        check_accounting(sch)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_a_withdrawn_prefilled_sequence_gives_back_its_blocks_but_the_lent_ones():
    sch = make(num_blocks=8, block_size=4, max_model_len=32)
    bm = sch.block_manager
    lent = bm.allocate(1)  # the caller's: a held block, say
    arrived = seq("kv", 6, max_tokens=3)
    arrived.output_token_ids, arrived.num_computed_tokens = [42], 6
    sch.admit_prefilled(arrived, lent)
    assert len(arrived.block_table) == 2 and bm.num_free_blocks == 6
    sch.withdraw_prefilled(arrived, num_lent=1)
    assert bm.num_free_blocks == 7 and arrived.block_table == [] and arrived.status == SequenceStatus.FINISHED
    assert not sch.has_unfinished and arrived.finish_reason == FinishReason.ABORT
    bm.free(lent)  # the caller's reference, still its own
    assert bm.num_free_blocks == 8
