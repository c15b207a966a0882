"""From an OpenAI-style JSON body to what the gateway generates: the prompt, SamplingParams and the response's options.

Every field is checked, and every error names its field (`param`) as OpenAI's do. A field kvferry
does not know, or knows but does not honour, is refused: a client that asked for it would read a
wrong answer otherwise.
"""

import math
from dataclasses import dataclass

from kvferry.common import settings
from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams

COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "user",
    # vLLM's extra sampling parameters
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "return_token_ids",  # vLLM's: each choice carries its output's token ids (kvferry replay compares them)
    # structured output (constraints.py): OpenAI's, and vLLM's with its older names
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
# Known, not honoured: accepted only with the value that asks for nothing.
NEUTRAL = {
    "best_of": (None, 1),
    "suffix": (None, ""),
}


@dataclass
class Limits:
    """What one request may ask for; each is a gateway setting (defaults from common/settings.py)."""

    max_body_bytes: int = settings.default("max_body_size")
    max_n: int = settings.default("max_n")
    max_tokens: int = settings.default("max_tokens_limit")
    max_stop: int = settings.default("max_stop")
    max_prompts: int = settings.default("max_prompts")  # prompts in one completions request
    max_stop_length: int = settings.default("max_stop_length")  # characters in one stop string
    max_stop_chars: int = settings.default("max_stop_chars")  # characters in all of them together
    max_prompt_chars: int = settings.default("max_prompt_chars")  # characters in the prompts or messages
    max_logprob_entries: int = settings.default("max_logprob_entries")  # in one response (response_size.py)


@dataclass
class Generation:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False  # completions: the prompt comes first, in text and in logprobs
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    prompt_only: bool = False  # echo with max_tokens 0: the prompt and its logprobs, nothing generated
    tool_calls: bool = False  # chat with tools it may call: the output's <tool_call> blocks become tool_calls
    return_token_ids: bool = False  # each choice (each chunk, streamed) carries its output's token ids
    continuous_usage: bool = False  # streamed: every chunk carries the usage so far


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def field(body: dict, name: str, types: tuple, default=None, check=None, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise ApiError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number", name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' is out of range: {value!r}", name)
    return value


def check_fields(body: dict, chat: bool) -> None:
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            raise ApiError(400, f"unknown parameter '{name}'", name)
        if name in NEUTRAL and body[name] not in NEUTRAL[name]:
            raise ApiError(400, f"'{name}' is not supported", name)


def parse_generation(
    body: dict,
    chat: bool,
    prompt_ids: list[int],
    max_model_len: int,
    vocab_size: int,
    limits: Limits,
    constraint: Constraint | None = None,
    tool_calls: bool = False,
) -> Generation:
    """constraint: what the output must match (constraints.py reads it from the body); tool_calls: parse the output's
    tool calls."""
    check_fields(body, chat)
    num_prompt = len(prompt_ids)
    if num_prompt >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {num_prompt} tokens, leaving none to generate.",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    echo = not chat and field(body, "echo", (bool,), False)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    lowest = 0 if echo else 1  # max_tokens 0 with echo: the prompt's logprobs alone (lm-evaluation-harness)
    max_tokens = field(body, name, (int,), None, lambda v: v >= lowest, f"an integer of at least {lowest}")
    if max_tokens is None:
        max_tokens = min(max_model_len - num_prompt, limits.max_tokens) if chat else 16
    if num_prompt + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} for the completion).",
            name,
            "context_length_exceeded",
        )
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"'{name}' may be at most {limits.max_tokens} on this server", name)
    n = field(body, "n", (int,), 1, lambda v: 1 <= v <= limits.max_n, f"an integer from 1 to {limits.max_n}")
    stream = field(body, "stream", (bool,), False)
    if body.get("stream_options") is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
    options = _stream_options(body)
    stop = _stop(body, limits)
    logprobs = _logprobs(body, chat)
    try:
        params = SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=field(body, "temperature", (int, float), 1.0),
            top_p=field(body, "top_p", (int, float), 1.0),
            top_k=field(body, "top_k", (int,), 0),
            seed=field(body, "seed", (int,), None),
            ignore_eos=field(body, "ignore_eos", (bool,), False),
            stop_token_ids=tuple(_token_ids(body, "stop_token_ids", vocab_size, MAX_STOP_TOKEN_IDS)),
            presence_penalty=field(body, "presence_penalty", (int, float), 0.0),
            frequency_penalty=field(body, "frequency_penalty", (int, float), 0.0),
            repetition_penalty=field(body, "repetition_penalty", (int, float), 1.0),
            min_p=field(body, "min_p", (int, float), 0.0),
            min_tokens=field(body, "min_tokens", (int,), 0),
            logit_bias=_logit_bias(body, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            constraint=constraint,
        )
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), str(exc).split(" ")[0]) from None
    return Generation(
        prompt_ids,
        params,
        stop or [],
        stream,
        options["include_usage"],
        n,
        echo,
        logprobs,
        prompt_only=echo and max_tokens == 0,
        tool_calls=tool_calls,
        return_token_ids=field(body, "return_token_ids", (bool,), False),
        continuous_usage=options["continuous_usage_stats"],
    )


def _stream_options(body: dict) -> dict[str, bool]:
    """stream_options: OpenAI's include_usage (a last chunk with the usage) and vLLM's continuous_usage_stats (the
    usage so far in every chunk), each true or false; any other key is refused."""
    options = field(body, "stream_options", (dict,), {}) or {}
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            shown = key if len(key) <= 100 else key[:100] + "..."
            raise ApiError(400, f"unknown parameter 'stream_options.{shown}'", "stream_options")
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"'stream_options.{key}' must be true or false", f"stream_options.{key}")
    return {key: bool(options.get(key)) for key in STREAM_OPTIONS}


def _logprobs(body: dict, chat: bool) -> int | None:
    in_range = lambda v: 0 <= v <= MAX_LOGPROBS
    if not chat:
        return field(body, "logprobs", (int,), None, in_range, f"an integer from 0 to {MAX_LOGPROBS}")
    wanted = field(body, "logprobs", (bool,), False)
    top = field(body, "top_logprobs", (int,), None, in_range, f"an integer from 0 to {MAX_LOGPROBS}")
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _stop(body: dict, limits: Limits) -> list[str] | None:
    """Each new token's text is matched against the stop strings, and held back while it may begin one: their
    number and length are bounded, each checked before the strings are looked at one by one."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return None
    wrong_type = ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if not isinstance(stop, list):
        raise wrong_type
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"at most {limits.max_stop} stop strings", "stop")
    if not all(isinstance(s, str) for s in stop):
        raise wrong_type
    if max(map(len, stop), default=0) > limits.max_stop_length:
        raise ApiError(400, f"a stop string may have at most {limits.max_stop_length} characters", "stop")
    if sum(map(len, stop)) > limits.max_stop_chars:
        raise ApiError(400, f"the stop strings may have at most {limits.max_stop_chars} characters together", "stop")
    return stop


def _token_ids(body: dict, name: str, vocab_size: int, most: int) -> list[int]:
    ids = field(body, name, (list,), [])
    if len(ids) > most:  # before the ids are looked at one by one
        raise ApiError(400, f"'{name}' may hold at most {most} token ids", name)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"'{name}' must be token ids in [0, {vocab_size})", name)
    return ids


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    bias = field(body, "logit_bias", (dict,), {})
    if len(bias) > MAX_LOGIT_BIAS:  # before the entries are looked at one by one
        raise ApiError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    out = []
    for key, value in bias.items():
        # ASCII digits only, and few of them: "²" and "٣" pass isdigit(), and int() of thousands of digits raises.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise ApiError(400, f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)
