"""Sampling a batch in which every row has its own parameters. Random rows draw by the exponential race (argmax
of p / Exp(1) noise), which equals sampling from p; a seeded row draws its noise from its own generator, so its
tokens depend only on its seed and its logits, never on what else shares the batch.
"""

from dataclasses import dataclass

import torch

from kvferry.common.model.host_staging import HostStaging, Staged
from kvferry.common.sampling import SamplingParams, TokenLogprobs


@dataclass
class SamplingTensors:
    """The random rows' parameters, staged with a step's host arrays; which filters run is decided on the host."""

    random_rows: list[int]
    rows: Staged | None  # the random rows' indices; None when every row is random
    temperatures: Staged
    top_ks: Staged | None  # None when no row filters by top_k or top_p; a top_k of 0 keeps the whole vocabulary
    top_ps: Staged | None
    min_ps: Staged | None  # None when no row has a min_p


def stage_sampling(params: list[SamplingParams], staging: HostStaging) -> SamplingTensors | None:
    """None when every row is greedy."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return None
    chosen = [params[i] for i in random_rows]
    filtered = any(p.top_k > 0 or p.top_p < 1 for p in chosen)
    return SamplingTensors(
        random_rows,
        None if len(random_rows) == len(params) else staging.add(random_rows, torch.long),
        staging.add([p.temperature for p in chosen], torch.float32),
        staging.add([p.top_k for p in chosen], torch.long) if filtered else None,
        staging.add([p.top_p for p in chosen], torch.float32) if filtered else None,
        staging.add([p.min_p for p in chosen], torch.float32) if any(p.min_p > 0 for p in chosen) else None,
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    constraints: list | None = None,
    staged: SamplingTensors | None = None,
) -> list[int]:
    """logits [num_rows, vocab] -> one token id per row. constraints: a ConstraintState or None per row, which
    limits the row's tokens. staged: params' tensors, staged with the step's inputs (default: staged here)."""
    if constraints is not None:
        logits = mask_constrained(logits, constraints)
    if staged is None:
        staging = HostStaging(logits.device)
        staged = stage_sampling(params, staging)
        staging.upload()
    if staged is None:
        return logits.argmax(dim=-1).tolist()
    rows = None if staged.rows is None else staged.rows.tensor
    sub = (logits if rows is None else logits[rows]).float()  # [R, vocab]
    sub = sub / staged.temperatures.tensor[:, None]
    if staged.top_ks is not None:
        sub = _apply_top_k_top_p(sub, staged.top_ks.tensor, staged.top_ps.tensor)
    probs = torch.softmax(sub, dim=-1)  # [R, vocab]
    if staged.min_ps is not None:
        # Relative to each row's likeliest token (0: removes nothing); the race needs no renormalisation.
        min_ps = staged.min_ps.tensor
        probs = probs.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs)
    for j, i in enumerate(staged.random_rows):
        noise[j].exponential_(generator=generators[i])
    sampled = exponential_race(probs, noise)
    if rows is None:
        return sampled.tolist()
    token_ids = logits.argmax(dim=-1)  # [N]: the greedy rows keep theirs
    token_ids[rows] = sampled
    return token_ids.tolist()


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The argmax of probs / noise per row (noise: Exp(1) draws). CUDA can draw exactly 0, and 0 / 0 is NaN, which
    argmax takes for the largest: a filtered token would win. So the draw is clamped to the smallest normal number."""
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def mask_constrained(logits: torch.Tensor, constraints: list) -> torch.Tensor:
    """The logits with every token a row's constraint forbids at -inf; a copy: logprobs report the model's."""
    rows = [i for i, state in enumerate(constraints) if state is not None]
    if not rows:
        return logits
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)  # [R, ceil(vocab / 32)] int32, on the CPU
    for j, i in enumerate(rows):
        constraints[i].fill(bitmask, j)
    masked = logits[rows].float()  # [R, vocab], a copy
    xgrammar.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True), vocab_size=vocab)
    if len(rows) == len(constraints):
        return masked
    out = logits.float().clone()  # [N, vocab]
    out[rows] = masked
    return out


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """top_ks [R] (0: no top_k), top_ps [R]: each row's kept tokens' logits, the others at -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, vocab]
    vocab = logits.shape[-1]
    ks = torch.where(top_ks > 0, top_ks, vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    cut = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token is cut when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= top_ps[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """The model's logits [num_rows, vocab] -> each chosen token's logprob and the num_top likeliest alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    chosen = logprobs.gather(-1, torch.tensor(token_ids, device=logits.device)[:, None])[:, 0].tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)  # [N, k]
    out = []
    for row, (token_id, n) in enumerate(zip(token_ids, num_top)):
        ids = tuple(top_ids[row, :n].tolist()) if n else ()
        values = tuple(top_values[row, :n].tolist()) if n else ()
        out.append(TokenLogprobs(token_id, chosen[row], ids, values))
    return out
