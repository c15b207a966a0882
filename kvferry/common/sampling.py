"""Per-request sampling parameters, validated where they enter the engine."""

import dataclasses
import math
from dataclasses import dataclass

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest

GREEDY_BELOW_TEMPERATURE = 1e-5
# Far past any use (the distribution is flat long before), and below float32's top, where 1 / T would be 0 and a
# masked token's -inf times it NaN.
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_TOP_K = 2**31 - 1  # past the vocabulary it cuts nothing; beyond this it would overflow the wire (a 500, once)
MAX_SEED = 2**63 - 1  # a signed 64-bit seed, as vLLM takes; fits torch's generator and msgpack
MAX_LOGIT_BIAS = 300  # entries in logit_bias, as OpenAI caps it
MAX_STOP_TOKEN_IDS = 1024  # a bound on what one request makes every step check, and on its message's size


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability under the model (log_softmax of its logits) and the top alternatives."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k cut
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability
    min_tokens: int = 0  # EOS and stop tokens are masked until this many are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # alternatives to report per generated token (0: the token only)
    prompt_logprobs: int | None = None  # the same for each prompt token (echo)
    constraint: Constraint | None = None  # structured output: what every sampled token must keep the output matching

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequest(f"top_k must be -1, 0 or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2 or not math.isfinite(self.repetition_penalty):
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"logit_bias takes at most {MAX_LOGIT_BIAS} entries and stop_token_ids at most {MAX_STOP_TOKEN_IDS}"
            )
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or token_id < 0 or not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias maps token ids to biases in [-100, 100], got {token_id}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}")

    @property
    def needs_processing(self) -> bool:
        """Whether its logits are changed before sampling (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows to inf; it is argmax in all but name.
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def for_choice(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of n draws from seed + i, wrapping round past MAX_SEED: each choice reproducible, different from the
    others, and valid whatever the seed (seed 2**63 - 1 with n = 2 once crashed a worker)."""
    if params.seed is None or choice == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + choice) % (MAX_SEED + 1))
