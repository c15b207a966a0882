"""The standard benchmark workloads, seeded so that every tool replays the same requests.

Request for request the same as the reference generator the project was specified with
(a test checks this when ../shared is present): log-uniform prompt and output lengths,
token ids clear of the special tokens at both ends of the vocabulary, Poisson arrivals.
"""
import math
import random

WORKLOADS = {  # name: (num_requests, (min, max) prompt tokens, (min, max) output tokens)
    "std-32": (32, (32, 384), (32, 256)),
    "std-128": (128, (32, 384), (32, 256)),
}


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def generate(name: str = "std-32", vocab_size: int = 49152, rate: float = 0.0, seed: int = 0) -> list[dict]:
    """Requests as dicts: id, prompt_token_ids, max_tokens, arrival_s (0 for all when rate is 0)."""
    num_requests, (prompt_lo, prompt_hi), (output_lo, output_hi) = WORKLOADS[name]
    rng = random.Random(f"{name}:{seed}")
    arrival = 0.0
    requests = []
    for i in range(num_requests):
        # The draw order (prompt length, prompt tokens, arrival gap, output length) is part of the contract.
        prompt_len = _log_uniform(rng, prompt_lo, prompt_hi)
        prompt = [rng.randrange(256, vocab_size - 256) for _ in range(prompt_len)]
        if rate > 0:
            arrival += rng.expovariate(rate)
        requests.append({"id": f"{name}-{i}", "prompt_token_ids": prompt,
                         "max_tokens": _log_uniform(rng, output_lo, output_hi), "arrival_s": round(arrival, 6)})
    return requests
