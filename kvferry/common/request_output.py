"""What the engine returns: each sequence's output of a step, and the counters a worker reports."""

from dataclasses import dataclass, field

from kvferry.common.sampling import TokenLogprobs
from kvferry.common.sequence import FinishReason


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # the new token's, when asked for
    logprobs: list[TokenLogprobs] | None = None  # every output token's so far, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for (echo)
    error: str = ""  # set when the step that served it failed: the request ended (finish_reason ABORT)


@dataclass
class EngineStats:
    """The engine's counters a worker reports in its heartbeats, named as in protocol.WorkerStats so that they
    pass into it whole."""

    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_prompt_tokens_cached: int
    num_cached_blocks: int
