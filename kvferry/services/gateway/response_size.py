"""How large a response a request asks for, bounded (--max-logprob-entries) before any work is routed.

Logprobs multiply a response: each token shown carries 1 + logprobs entries, each choice shows its own tokens, and echo
shows the whole prompt in every choice (n 16, logprobs 20, echo of 30,000 tokens: 10 million entries). A whole
response holds every entry at once; a stream one event's a chunk, but each choice's first carries its echoed prompt.
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
