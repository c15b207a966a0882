"""One sequence's state in an engine: its tokens, progress and block table as the scheduler sees them, and what
the engine and its model runner keep for it from step to step. Everything an engine holds for a sequence is here,
so it goes when the sequence goes."""

import enum
import typing
from dataclasses import dataclass, field

from kvferry.common.sampling import SamplingParams, TokenLogprobs

if typing.TYPE_CHECKING:
    from kvferry.common.structured.matcher import ConstraintState


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS or a stop token
    LENGTH = 1  # max_tokens or the model's maximum length
    ABORT = 2
    DEAD_END = 3  # the constraint allows no token: its grammar conflicts with min_tokens, or the vocabulary lacks one


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # monotonically increasing admission order; preemption picks the largest
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. After preemption it falls back to 0 and the
    # prompt plus the outputs so far are recomputed as one longer prompt.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks, as far as known
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache at admission
    # Its structured-output matcher (common/structured/matcher.py), when params.constraint is set: advanced with
    # every output token, kept through preemption, rebuilt from the tokens wherever the sequence moves.
    constraint_state: "ConstraintState | None" = None
    # Finished, its blocks kept for the engine's connector (a prefill worker's transfer) until LLMEngine.release().
    kept: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # each output's, when params.logprobs asks
    # When params.prompt_logprobs asks: entry p is prompt token p's logprobs given the tokens before it (0: None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
