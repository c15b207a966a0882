"""Every field each endpoint takes, declared once (request_schema.py). Adding an API parameter is one line here; the
unknown-field refusal, its checks and /openapi.json follow. Bounds come from GatewayConfig (`limits`) or
common/sampling.py.
"""

import dataclasses
import functools

from kvferry.common.gateway_config import GatewayConfig
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, MAX_STOP_TOKEN_IDS, MAX_TOP_K
from kvferry.services.gateway import other_fields
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.request_schema import ARRAY, BOOLEAN, INTEGER, NUMBER, OBJECT, STRING, Param, Schema

# Each request's name in /openapi.json
COMPLETIONS, CHAT = "CompletionRequest", "ChatCompletionRequest"
TOKENIZE, DETOKENIZE = "TokenizeRequest", "DetokenizeRequest"


_FIELDS = tuple(f.name for f in dataclasses.fields(GatewayConfig))


def schema_of(name: str, limits: GatewayConfig) -> Schema:
    """The named request's schema under these limits, built once for each. Keyed by the limits' values read shallowly
    (GatewayConfig is not hashable, and dataclasses.astuple's deep copy costs more than a body's read)."""
    return _built(name, tuple(map(limits.__getattribute__, _FIELDS)))


@functools.lru_cache(maxsize=32)
def _built(name: str, limits: tuple) -> Schema:
    return BUILDERS[name](GatewayConfig(*limits))


def _sampling(limits: GatewayConfig) -> dict[str, Param]:
    """The fields both generation endpoints share."""
    max_tokens = limits.max_tokens_limit
    stop_doc = (
        f"at most {limits.max_stop} strings of at most {limits.max_stop_length} characters each, "
        f"{limits.max_stop_chars} characters together"
    )
    stop_string = {"type": STRING, "maxLength": limits.max_stop_length}
    stream_options = {
        "include_usage": Param(BOOLEAN, doc="a last chunk, with no choices, carries the request's usage"),
        "continuous_usage_stats": Param(BOOLEAN, doc="vLLM's: every chunk carries the request's usage so far"),
    }
    return {
        "model": Param(STRING),
        "temperature": Param(NUMBER, lo=0, default=1.0),
        "top_p": Param(NUMBER, lo=0, hi=1, above_lo=True, default=1.0),
        "top_k": Param(INTEGER, lo=-1, hi=MAX_TOP_K, default=0, doc="0 or -1: no top-k cut"),
        "min_p": Param(NUMBER, lo=0, hi=1, default=0.0),
        "n": Param(INTEGER, lo=1, hi=limits.max_n, default=1),
        "seed": Param(INTEGER, lo=0, hi=MAX_SEED),
        "presence_penalty": Param(NUMBER, lo=-2, hi=2, default=0.0),
        "frequency_penalty": Param(NUMBER, lo=-2, hi=2, default=0.0),
        "repetition_penalty": Param(NUMBER, lo=0, hi=2, above_lo=True, default=1.0),
        "min_tokens": Param(INTEGER, lo=0, hi=max_tokens, default=0),
        "ignore_eos": Param(BOOLEAN, default=False),
        "return_token_ids": Param(
            BOOLEAN,
            default=False,
            doc="each choice (each streamed chunk) carries the output's token ids in token_ids, as vLLM's",
        ),
        "stop_token_ids": Param(
            ARRAY,
            default=(),
            read=functools.partial(_token_ids, most=MAX_STOP_TOKEN_IDS),
            spec={"items": {"type": INTEGER, "minimum": 0}, "maxItems": MAX_STOP_TOKEN_IDS},
        ),
        "stop": Param(
            read=functools.partial(_stop, limits=limits),
            spec={"oneOf": [stop_string, {"type": ARRAY, "items": stop_string, "maxItems": limits.max_stop}]},
            doc=stop_doc,
        ),
        "logit_bias": Param(
            OBJECT,
            default=(),
            read=_logit_bias,
            spec={
                "additionalProperties": {"type": NUMBER, "minimum": -100, "maximum": 100},
                "maxProperties": MAX_LOGIT_BIAS,
            },
        ),
        "stream": Param(BOOLEAN, default=False),
        "stream_options": Param(OBJECT, fields=Schema(stream_options), doc="only with stream: true"),
        "user": Param(STRING),
        # The output constraints, checked by constraints.py (docs/structured-output.md)
        **{name: Param(spec=spec, doc=doc) for name, (spec, doc) in other_fields.STRUCTURED.items()},
    }


def completions(limits: GatewayConfig) -> Schema:
    params = {
        "prompt": Param(spec=other_fields.prompt(limits.max_prompts)),  # checked by Api.prompt_ids
        **_sampling(limits),
        # 0 only with echo: the prompt's logprobs alone (parse_generations); the limit after the context's
        "max_tokens": Param(INTEGER, lo=0, hi=limits.max_tokens_limit, check_hi=False, default=None),
        "logprobs": Param(INTEGER, lo=0, hi=MAX_LOGPROBS),
        "echo": Param(BOOLEAN, default=False),
        "best_of": Param(INTEGER, only=(1,)),
        "suffix": Param(STRING, only=("",)),
    }
    return Schema(params, required=("prompt",))


def chat(limits: GatewayConfig) -> Schema:
    params = {
        "messages": Param(spec=other_fields.MESSAGES),  # checked by chat_messages.py
        **_sampling(limits),
        "max_tokens": Param(INTEGER, lo=1, hi=limits.max_tokens_limit, check_hi=False),
        "max_completion_tokens": Param(INTEGER, lo=1, hi=limits.max_tokens_limit, check_hi=False),
        "logprobs": Param(BOOLEAN, default=False),
        "top_logprobs": Param(INTEGER, lo=0, hi=MAX_LOGPROBS),
        **_tools(),
    }
    return Schema(params, required=("messages",))


def _tools() -> dict[str, Param]:
    """Chat's tools, checked by tools.py: calls are generated as <tool_call> blocks, returned as message.tool_calls."""
    return {
        "tools": Param(spec=other_fields.tools()),
        "tool_choice": Param(spec=other_fields.TOOL_CHOICE, doc='default "auto" with tools, "none" without'),
        "parallel_tool_calls": Param(BOOLEAN, default=True),
    }


def tokenize(limits: GatewayConfig) -> Schema:
    params = {
        "model": Param(STRING),
        "prompt": Param(STRING),
        "messages": Param(spec=other_fields.MESSAGES),
        **{name: param for name, param in _tools().items() if name != "parallel_tool_calls"},
        "add_special_tokens": Param(BOOLEAN, default=True),
        "add_generation_prompt": Param(BOOLEAN, default=True),
    }
    return Schema(params, closed=False)  # read by TokenizerRoutes.tokenize


def detokenize(limits: GatewayConfig) -> Schema:
    return Schema({"model": Param(STRING), "tokens": Param(spec=other_fields.TOKEN_IDS)}, ("tokens",), closed=False)


BUILDERS = {COMPLETIONS: completions, CHAT: chat, TOKENIZE: tokenize, DETOKENIZE: detokenize}


def _stop(name: str, stop, vocab_size: int, limits: GatewayConfig) -> list[str]:
    """Each new token's text is matched against the stop strings, and held back while it may begin one: their
    number and length are bounded, each checked before the strings are looked at one by one."""
    stop = [stop] if isinstance(stop, str) else stop
    wrong_type = ApiError(400, f"'{name}' must be a string or a list of strings", name)
    if not isinstance(stop, list):
        raise wrong_type
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"at most {limits.max_stop} stop strings", name)
    if not all(isinstance(s, str) for s in stop):
        raise wrong_type
    if max(map(len, stop), default=0) > limits.max_stop_length:
        raise ApiError(400, f"a stop string may have at most {limits.max_stop_length} characters", name)
    if sum(map(len, stop)) > limits.max_stop_chars:
        raise ApiError(400, f"the stop strings may have at most {limits.max_stop_chars} characters together", name)
    return stop


def _token_ids(name: str, ids: list, vocab_size: int, most: int) -> tuple[int, ...]:
    if len(ids) > most:  # before the ids are looked at one by one
        raise ApiError(400, f"'{name}' may hold at most {most} token ids", name)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"'{name}' must be token ids in [0, {vocab_size})", name)
    return tuple(ids)


def _logit_bias(name: str, bias: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if len(bias) > MAX_LOGIT_BIAS:  # before the entries are looked at one by one
        raise ApiError(400, f"'{name}' may hold at most {MAX_LOGIT_BIAS} entries", name)
    out = []
    for key, value in bias.items():
        # ASCII digits only, and few of them: "²" and "٣" pass isdigit(), and int() of thousands of digits raises.
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise ApiError(400, f"'{name}' key {key!r} is not a token id in [0, {vocab_size})", name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(400, f"'{name}' values must be numbers in [-100, 100], got {value!r}", name)
        out.append((int(key), float(value)))
    return tuple(out)
