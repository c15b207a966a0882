"""From an OpenAI-style JSON body to what the gateway generates: the prompt, SamplingParams and the response's options.

The body is read through its endpoint's schema (request_fields.py), where every field is checked and every error
names its field (`param`). A field kvferry does not know, or knows but does not honour, is refused: a client that
asked for it would read a wrong answer otherwise. Left here is what no one field says: the context length, max_tokens
0 only with echo, top_logprobs only with logprobs, stream_options only with stream.
"""

import dataclasses
from dataclasses import dataclass

from kvferry.common.constraint import Constraint
from kvferry.common.errors import InvalidRequest
from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import SamplingParams
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.request_fields import CHAT, COMPLETIONS, schema_of

# A body's field named as one of SamplingParams' goes to it as read (so a new sampling parameter is its Param in
# request_fields.py, beside the engine's field); these are worked out from several fields instead.
DERIVED = ("max_tokens", "logprobs", "prompt_logprobs", "constraint")
SAMPLING = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in DERIVED)


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


def check_fields(body: dict, chat: bool) -> None:
    """An unknown field, or one not honoured, refused before anything else is looked at (the names are the same
    whatever the limits)."""
    schema_of(CHAT if chat else COMPLETIONS, GatewayConfig()).check_names(body)


def parse_generations(
    body: dict,
    chat: bool,
    prompts: list[list[int]],
    max_model_len: int,
    vocab_size: int,
    limits: GatewayConfig,
    constraint: Constraint | None = None,
    tool_calls: bool = False,
) -> list[Generation]:
    """One Generation per prompt, the body read once. limits: the gateway's settings, which bound what a request may
    ask for; constraint: what the output must match (constraints.py reads it from the body); tool_calls: parse the
    output's tool calls."""
    schema = schema_of(CHAT if chat else COMPLETIONS, limits)
    values = schema.read(body, vocab_size)
    echo = values.get("echo", False)  # completions only
    name = "max_completion_tokens" if values.get("max_completion_tokens") is not None else "max_tokens"
    most, options = schema.params[name].hi, values["stream_options"] or {}
    generations = []
    for prompt_ids in prompts:
        num_prompt = len(prompt_ids)
        if num_prompt >= max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"has {num_prompt} tokens, leaving none to generate.",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        max_tokens = values[name]
        if max_tokens is not None and max_tokens < 1 and not echo:
            raise ApiError(400, f"'{name}' must be an integer of at least 1 (0 only with echo)", name)
        if max_tokens is None:
            max_tokens = min(max_model_len - num_prompt, most) if chat else 16
        if num_prompt + max_tokens > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).",
                name,
                "context_length_exceeded",
            )
        if max_tokens > most:
            raise ApiError(400, f"'{name}' may be at most {most} on this server", name)
        if values["stream_options"] is not None and not values["stream"]:
            raise ApiError(400, "'stream_options' is only allowed with stream=true", "stream_options")
        logprobs = _logprobs(values, chat)
        try:
            params = SamplingParams(
                max_tokens=max(1, max_tokens),
                **{key: values[key] for key in SAMPLING if key in values},
                logprobs=logprobs,
                prompt_logprobs=logprobs if echo else None,
                constraint=constraint,
            )
        except InvalidRequest as exc:  # what no one field says: min_tokens past max_tokens
            raise ApiError(400, str(exc), str(exc).split(" ")[0]) from None
        generations.append(
            Generation(
                prompt_ids,
                params,
                values["stop"] or [],
                values["stream"],
                bool(options.get("include_usage")),
                values["n"],
                echo,
                logprobs,
                prompt_only=echo and max_tokens == 0,
                tool_calls=tool_calls,
                return_token_ids=values["return_token_ids"],
                continuous_usage=bool(options.get("continuous_usage_stats")),
            )
        )
    return generations


def _logprobs(values: dict, chat: bool) -> int | None:
    if not chat:
        return values["logprobs"]
    top = values["top_logprobs"]
    if top is not None and not values["logprobs"]:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if values["logprobs"] else None
