"""The benchmark workloads, seeded so that every tool replays the same requests, and the random decode batch the
in-process step measures start from.

std-*: request for request the reference generator the project was specified with (tests/unit/
test_workload_and_floor.py holds this). The scenarios that measure one feature each: shared-prefix (prefix caching:
32 requests behind one 400-token system prompt), head-of-line (chunked prefill: a 4,000-token prompt, then 16 short
ones whose TTFT it must not hold back), single-stream (one request alone: its TPOT is the inter-token latency).
The sampled twins of std-32 are its requests with the sampling real chat traffic uses, a seed per request so
that every run samples the same tokens: greedy is the cheapest case, and a figure taken only greedy hides the
sampler's cost.
"""

import math
import random

WORKLOADS = {  # name: (num_requests, (min, max) prompt tokens, (min, max) output tokens)
    "std-32": (32, (32, 384), (32, 256)),
    "std-128": (128, (32, 384), (32, 256)),
}
SAMPLED = {  # name: (the workload whose requests it takes, the sampling every request adds)
    "std-32-t0.8": ("std-32", {"temperature": 0.8}),
    "std-32-t0.8-top-p0.95": ("std-32", {"temperature": 0.8, "top_p": 0.95}),
}
GREEDY = {"temperature": 0.0}


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def generate(name: str = "std-32", vocab_size: int = 49152, rate: float = 0.0, seed: int = 0) -> list[dict]:
    """Requests as dicts: id, prompt_token_ids, max_tokens, arrival_s (0 for all when rate is 0), a group
    where a scenario reports some requests apart, and the sampling fields of a sampled workload (else greedy)."""
    if name in SCENARIOS:
        return SCENARIOS[name](random.Random(f"{name}:{seed}"), vocab_size, rate)
    if name in SAMPLED:
        base, sampling = SAMPLED[name]
        return [dict(r, sampling=sampling | {"seed": i}) for i, r in enumerate(generate(base, vocab_size, rate, seed))]
    num_requests, (prompt_lo, prompt_hi), (output_lo, output_hi) = WORKLOADS[name]
    rng = random.Random(f"{name}:{seed}")
    arrival = 0.0
    requests = []
    for i in range(num_requests):
        # The draw order (prompt length, prompt tokens, arrival gap, output length) is part of the contract.
        prompt = _tokens(rng, vocab_size, _log_uniform(rng, prompt_lo, prompt_hi))
        if rate > 0:
            arrival += rng.expovariate(rate)
        requests.append(_request(f"{name}-{i}", prompt, _log_uniform(rng, output_lo, output_hi), arrival))
    return requests


def for_round(requests: list[dict], round_index: int, vocab_size: int) -> list[dict]:
    """The workload for repeat round_index of a run that replays it several times on one server: every prompt's
    first token moved by the round, so that no round finds an earlier round's prompts in a prefix cache (every
    block hash chains from the first block). Lengths, and prefixes shared within the workload, stay as they are."""
    if round_index == 0:
        return requests
    span = vocab_size - 512  # ids clear of the specials at both ends, as generated

    def moved(token: int) -> int:
        return 256 + (token - 256 + round_index * 7919) % span

    return [dict(r, prompt_token_ids=[moved(r["prompt_token_ids"][0]), *r["prompt_token_ids"][1:]]) for r in requests]


def _tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(256, vocab_size - 256) for _ in range(n)]


def _request(request_id: str, prompt: list[int], max_tokens: int, arrival_s: float, **group) -> dict:
    return {
        "id": request_id,
        "prompt_token_ids": prompt,
        "max_tokens": max_tokens,
        "arrival_s": round(arrival_s, 6),
        **group,
    }


def _shared_prefix(rng: random.Random, vocab_size: int, rate: float) -> list[dict]:
    system = _tokens(rng, vocab_size, 400)
    requests, arrival = [], 0.0
    for i in range(32):
        if rate > 0:
            arrival += rng.expovariate(rate)
        own = _tokens(rng, vocab_size, rng.randint(50, 100))
        requests.append(_request(f"shared-prefix-{i}", system + own, rng.randint(50, 100), arrival))
    return requests


def _head_of_line(rng: random.Random, vocab_size: int, rate: float) -> list[dict]:
    requests = [_request("head-of-line-long", _tokens(rng, vocab_size, 4000), 16, 0.0, group="long")]
    for i in range(16):  # a little apart, as requests come, once the long prompt is under way
        requests.append(_request(f"head-of-line-{i}", _tokens(rng, vocab_size, 64), 16, 0.3 + 0.01 * i, group="short"))
    return requests


def _single_stream(rng: random.Random, vocab_size: int, rate: float) -> list[dict]:
    return [_request("single-stream", _tokens(rng, vocab_size, 128), 64, 0.0)]


def warmup(vocab_size: int, max_tokens: int | None = None) -> list[dict]:
    """Two requests that share no prefix with any workload: warming up must not fill the prefix cache for it."""
    requests = generate("std-32", vocab_size, seed=99)[:2]
    return requests if max_tokens is None else [dict(r, max_tokens=max_tokens) for r in requests]


def warmup_prompt(vocab_size: int) -> list[int]:
    return warmup(vocab_size)[0]["prompt_token_ids"]


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    """Token ids clear of the special tokens at both ends of a real vocabulary (of a test model's small one: 0-2)."""
    low, high = (256, vocab_size - 256) if vocab_size > 1024 else (3, vocab_size)
    return [rng.randrange(low, high) for _ in range(length)]


def start_decoding(engine, rng: random.Random, batch: int, context: int, params) -> None:
    """In process: batch prompts of context random tokens through the engine, prefilled: from its next step on,
    every sequence decodes."""
    for _ in range(batch):
        engine.add_request(random_prompt(rng, engine.vocab_size, context), params)
    while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()


def abort_all(engine) -> None:
    for seq in [*engine.scheduler.waiting, *engine.scheduler.running]:
        engine.abort(seq.request_id)


SCENARIOS = {"shared-prefix": _shared_prefix, "head-of-line": _head_of_line, "single-stream": _single_stream}
NAMES = [*WORKLOADS, *SAMPLED, *SCENARIOS]


def sampling(request: dict) -> dict:
    """A request's sampling fields, as the API and SamplingParams both name them."""
    return request.get("sampling", GREEDY)
