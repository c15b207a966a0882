"""Continuous batching: which sequences run in the next step, and how many tokens each.

Pure and deterministic: it owns the waiting and running queues and the block manager, takes sampled tokens back
through `update`, and never touches tensors. A step is either a prefill step (prompt chunks, at most
`max_num_batched_tokens` tokens in all) or a decode step (one token for every running sequence). Prompts go first, so
a new request joins the running batch at the next step; a sequence leaves it on the step it finishes.

Chunked prefill: a prompt computes at most `long_prefill_threshold` tokens a step, and the rest of the budget goes to
the prompts behind it, so one long prompt does not hold back the short ones' first tokens. Without chunking a prompt
is computed in one step (alone when it is longer than the budget). When a decode step runs out of blocks, the newest
sequence is preempted: its blocks are freed and it is recomputed later as one longer prompt.
"""

import bisect
import itertools
from dataclasses import dataclass, field

from kvferry.common.block_hash import block_hashes
from kvferry.common.block_manager import BlockManager
from kvferry.common.errors import ConfigError
from kvferry.common.finish_rules import FinishRules
from kvferry.common.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so that its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    is_prefill: bool
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler(FinishRules):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        keep_finished_blocks: bool = False,
        enable_chunked_prefill: bool = True,
        long_prefill_threshold: int = 0,
    ):
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            # A decode step runs one token per sequence, all under the same budget.
            raise ConfigError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_num_seqs ({max_num_seqs})"
            )
        if block_manager.num_blocks * block_manager.block_size < max_model_len:
            raise ConfigError(
                f"the KV pool ({block_manager.num_blocks * block_manager.block_size} tokens) "
                f"cannot hold one sequence of max_model_len={max_model_len} tokens"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        FinishRules.__init__(self, eos_token_ids, max_model_len)  # self.max_model_len, self.eos_token_ids
        self.enable_chunked_prefill = enable_chunked_prefill
        # A prompt's most tokens in one step (0: the whole budget).
        self.long_prefill_threshold = min(long_prefill_threshold or max_num_batched_tokens, max_num_batched_tokens)
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (recomputes included)
        self.num_cached_prompt_tokens = 0  # prompt tokens whose KV the prefix cache supplied
        self._arrivals = itertools.count()
        # A prefill worker keeps a finished prompt's blocks until a decode worker holds their copy,
        # then hands them back with `release`. Aborted sequences always free at once.
        self.keep_finished_blocks = keep_finished_blocks

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting prompts' (less what the prefix cache holds for them now)
        and the rest of the prompts cut by the token budget. The gateway balances prefill workers on it."""
        size = self.block_manager.block_size
        return sum(s.num_uncomputed_tokens - len(self._cached_prefix(s)) * size for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1
        )

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def _prefilled_blocks(self, num_tokens: int, num_choices: int) -> int:
        """Blocks for num_choices sequences of num_tokens tokens sharing their prompt's full blocks: those once,
        the rest (the partly filled block, and room for the first token) once per choice."""
        num_shared = (num_tokens - 1) // self.block_manager.block_size
        return num_shared + num_choices * (self.block_manager.num_blocks_for(num_tokens) - num_shared)

    def can_admit_prefilled(self, num_tokens: int, num_choices: int = 1, num_held: int = 0) -> bool:
        """num_held: leading blocks the caller holds already (kept for a transfer that leaves them out)."""
        return len(self.running) + num_choices <= self.max_num_seqs and self.block_manager.can_allocate(
            self._prefilled_blocks(num_tokens, num_choices) - num_held
        )

    def could_ever_admit_prefilled(self, num_tokens: int, num_choices: int = 1) -> bool:
        """Whether an empty worker could take them: if not, waiting for room is pointless."""
        return (
            num_choices <= self.max_num_seqs
            and self._prefilled_blocks(num_tokens, num_choices) <= self.block_manager.num_blocks
        )

    def admit_prefilled(self, seq: Sequence, shared_blocks: list[int] = ()) -> None:
        """Admit a sequence whose first num_computed_tokens already have KV elsewhere (a decode worker
        receiving a transfer). Its table starts with shared_blocks (already referenced by the caller: another
        choice's full prompt blocks, or cached blocks held for a transfer); the rest is allocated, and the caller
        fills it before the next step, where the sequence joins the running batch."""
        assert seq.num_uncomputed_tokens == 1 and not seq.block_table
        seq.block_table.extend(shared_blocks)
        self.block_manager.grow(seq.block_table, seq.num_tokens)
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)  # the newest arrival: running stays sorted
        self._register_full_blocks(seq)  # the caller writes their KV before anything can read it

    def withdraw_prefilled(self, seq: Sequence, num_lent: int) -> None:
        """Undo admit_prefilled for a sequence that has not run yet: it leaves the running queue and frees what it
        referenced, but its first num_lent blocks, whose references stay with the caller that lent them."""
        assert seq.num_uncomputed_tokens == 1 and seq.status == SequenceStatus.RUNNING
        self.running.remove(seq)
        self.block_manager.free(seq.block_table[num_lent:])
        seq.block_table = []
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT

    def release(self, seq: Sequence) -> None:
        """Free the blocks a finished sequence kept (keep_finished_blocks)."""
        assert seq.is_finished
        self.block_manager.free(seq.block_table)
        seq.block_table = []

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                    return seq
        return None

    def schedule(self) -> StepPlan:
        plan = self._schedule_prefill()
        return plan if plan.chunks else self._schedule_decode()

    def _schedule_prefill(self) -> StepPlan:
        plan = StepPlan(is_prefill=True)
        budget = self.max_num_batched_tokens
        computing: set[bytes] = set()  # hashes of the blocks this step computes
        # Prompts already admitted but cut by an earlier step's budget continue first.
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and budget > 0:
                budget -= self._add_chunk(plan, seq, budget, computing)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            hits = self._cached_prefix(seq)
            if len(seq.block_hashes) > len(hits) and seq.block_hashes[len(hits)] in computing:
                # Its next block is being computed in this step by another prompt: wait one step and reuse it
                # rather than compute it twice.
                i += 1
                continue
            # A prompt's blocks are reserved whole on admission, so a chunked prompt never stalls half-way.
            bm = self.block_manager
            if not self.enable_chunked_prefill and seq.num_tokens - len(hits) * bm.block_size > budget and plan.chunks:
                break  # unchunked, it does not fit beside what the step has: it leads the next step
            num_new_blocks = bm.num_blocks_for(seq.num_tokens) - len(hits) + bm.num_free_among(hits)
            if not bm.can_allocate(num_new_blocks):
                break
            self.waiting.pop(i)
            bm.take_cached(hits)
            seq.block_table = list(hits)
            seq.num_registered_blocks = len(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * bm.block_size
            self.num_cached_prompt_tokens += seq.num_computed_tokens
            bm.grow(seq.block_table, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            budget -= self._add_chunk(plan, seq, budget, computing)
        self.num_computed_prompt_tokens += plan.num_tokens
        return plan

    def _add_chunk(self, plan: StepPlan, seq: Sequence, budget: int, computing: set[bytes]) -> int:
        """Schedule the next chunk of a prompt: as much as the budget and the per-prompt cap allow, or all of it
        without chunking. Returns its number of tokens."""
        n = seq.num_uncomputed_tokens
        if self.enable_chunked_prefill:
            n = min(n, budget, self.long_prefill_threshold)
        plan.chunks.append(ScheduledChunk(seq, n))
        computing.update(self._hashes_computed(seq, n))
        return n

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the start of a waiting sequence's tokens. The last token is always computed (its
        logits give the next token), so the block holding it is never taken from the cache."""
        bm = self.block_manager
        if not bm.enable_caching or seq.params.prompt_logprobs is not None:  # those need every prompt position
            return []
        seq.block_hashes = block_hashes(seq.token_ids, bm.block_size, seq.block_hashes)
        return bm.match_prefix(seq.block_hashes[: bm.num_cacheable_blocks(seq.num_tokens)])

    def _hashes_computed(self, seq: Sequence, num_new_tokens: int) -> list[bytes]:
        """Hashes of the blocks that a chunk of num_new_tokens fills."""
        size = self.block_manager.block_size
        return seq.block_hashes[seq.num_computed_tokens // size : (seq.num_computed_tokens + num_new_tokens) // size]

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks whose KV is now complete to the prefix cache."""
        bm = self.block_manager
        num_full = seq.num_computed_tokens // bm.block_size
        if not bm.enable_caching or num_full <= seq.num_registered_blocks:
            return
        if len(seq.block_hashes) < num_full:
            seq.block_hashes = block_hashes(seq.token_ids[: num_full * bm.block_size], bm.block_size, seq.block_hashes)
        for i in range(seq.num_registered_blocks, num_full):
            bm.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_registered_blocks = num_full

    def _schedule_decode(self) -> StepPlan:
        plan = StepPlan(is_prefill=False)
        bm, size = self.block_manager, self.block_manager.block_size
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = seq.num_tokens
            if len(seq.block_table) * size < num_tokens:  # its new token starts a block
                while not bm.can_allocate(bm.blocks_needed(seq.block_table, num_tokens)):
                    victim = self.running[-1]
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    continue
                bm.grow(seq.block_table, num_tokens)
            plan.chunks.append(ScheduledChunk(seq, 1))
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def update(self, plan: StepPlan, sampled_token_ids: list[int | None]) -> list[Sequence]:
        """Record a step's results; sampled_token_ids has one entry per chunk (None where it did not sample).
        Returns the sequences that finished in this step."""
        assert len(sampled_token_ids) == len(plan.chunks)
        finished = []
        running, size = SequenceStatus.RUNNING, self.block_manager.block_size
        for chunk, token_id in zip(plan.chunks, sampled_token_ids):
            seq = chunk.seq
            if seq.status is not running:
                continue  # aborted while the step ran
            num_computed = seq.num_computed_tokens + chunk.num_new_tokens
            # chunk.samples, spelled out: a decode step asks it of every sequence
            assert (token_id is not None) == (num_computed == len(seq.prompt_token_ids) + len(seq.output_token_ids))
            seq.num_computed_tokens = num_computed
            if num_computed // size > seq.num_registered_blocks:  # a block filled (the call's own first test)
                self._register_full_blocks(seq)
            if token_id is None:
                continue
            state = seq.constraint_state
            if state is not None and not state.accept(token_id):  # its constraint had masked every token out
                reason = FinishReason.DEAD_END
            else:
                seq.output_token_ids.append(token_id)
                reason = self.finish_reason(seq.params, token_id, len(seq.output_token_ids), seq.num_tokens, state)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if reason == FinishReason.ABORT or not self.keep_finished_blocks:
            self.block_manager.free(seq.block_table)
            seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
