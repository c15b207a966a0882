"""How large a response a request asks for, bounded before any work is routed.

Logprobs multiply a response: every token it shows carries 1 + logprobs entries, every choice shows its own
tokens, and echo shows the whole prompt in every choice. n 16 with logprobs 20 and echo on a prompt of 30,000
tokens asks for 10 million entries: a gigabyte of Python objects and seconds of serializing. Their product is
bounded by --max-logprob-entries, computed from the parsed fields alone, and the refusal names the fields to lower.

A whole response holds every entry at once; a stream holds one event's tokens a chunk, except each choice's first
chunk, which carries its echoed prompt: for a stream only the echoed prompts count.
"""

from kvferry.common import settings
from kvferry.common.gateway_config import GatewayConfig
from kvferry.services.gateway.api_error import ApiError
from kvferry.services.gateway.request_parsing import Generation


def num_logprob_entries(generations: list[Generation]) -> int:
    """The most logprob entries the response holds at once (0 without logprobs)."""
    return sum(g.n * _tokens_held(g) * (1 + g.logprobs) for g in generations if g.logprobs is not None)


def _tokens_held(g: Generation) -> int:
    echoed = len(g.prompt_ids) if g.echo else 0
    return echoed if g.stream or g.prompt_only else echoed + g.params.max_tokens


def check_response_size(generations: list[Generation], chat: bool, body: dict, limits: GatewayConfig) -> None:
    """A 400 naming the fields that multiply the response, when it would hold more than --max-logprob-entries."""
    num = num_logprob_entries(generations)
    most = limits.max_logprob_entries
    if num <= most:
        return
    g = generations[0]  # what the prompts share: n, logprobs, echo, stream, max_tokens
    width = "top_logprobs" if chat else "logprobs"
    tokens = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    terms = []
    if g.echo:
        terms.append(f"echo: {sum(len(x.prompt_ids) for x in generations)} prompt tokens")
    if not (g.stream or g.prompt_only):
        unset = " (unset: the context left)" if body.get(tokens) is None else ""
        per_prompt = f" for each of {len(generations)} prompts" if len(generations) > 1 else ""
        terms.append(f"{tokens} {g.params.max_tokens}{unset}{per_prompt}")
    raise ApiError(
        400,
        f"the response would hold up to {num} logprob entries, n {g.n} x ({' + '.join(terms)}) x (1 + {width} "
        f"{g.logprobs}); this server allows {most} ({settings.label('max_logprob_entries')}). Lower n, {width} or "
        f"{tokens}{', drop echo' if g.echo else ''}{', or stream the response' if not g.stream else ''}",
        width,
    )
