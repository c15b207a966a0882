"""When a sequence ends with the token it has just taken: one rule for the engine's scheduler and for the synthetic
workers (the bench's test doubles, tools/bench/synthetic/), so that a double ends a stream where a real worker would.
Pure: plain ints and the request's SamplingParams, no model."""

from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason


class FinishRules:
    """A model's ends of generation: its EOS token ids, and its longest sequence. The Scheduler is one (a base
    class, not an attribute: its finish_reason stays a plain method call, on the per-token path)."""

    def __init__(self, eos_token_ids, max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def finish_reason(
        self, params: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int, constraint_state=None
    ) -> FinishReason | None:
        """Whether a sequence ends with token_id, its num_output_tokens-th output (num_tokens in all), which its
        constraint state (if any) has accepted. STOP before LENGTH: a stop token id ends it always, EOS unless
        ignore_eos, a complete constraint even with ignore_eos. min_tokens is not checked here: the sampler masks
        the stop and EOS tokens until then (model/logits_processors.py)."""
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return FinishReason.STOP
        if constraint_state is not None and constraint_state.terminated:
            return FinishReason.STOP
        if num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
