"""Sampling a batch in which every row has its own parameters.

Random rows draw by the exponential race (argmax of p / Exp(1) noise), which equals
sampling from p. A seeded row draws its noise from its own generator, so its tokens
depend only on its seed and its logits, never on what else shares the batch.
"""

import torch

from kvferry.common.sampling import SamplingParams, TokenLogprobs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    constraints: list | None = None,
) -> list[int]:
    """logits [num_rows, vocab] -> one token id per row. constraints: a ConstraintState or None per row; a row with
    one samples only among the tokens it allows, whatever the sampling method."""
    if constraints is not None:
        logits = mask_constrained(logits, constraints)
    greedy_ids = logits.argmax(dim=-1)  # [N]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy_ids.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    sub = logits[rows].float()  # [R, vocab]
    sub = sub / torch.tensor([params[i].temperature for i in random_rows], device=sub.device)[:, None]
    top_ks = [params[i].top_k for i in random_rows]
    top_ps = [params[i].top_p for i in random_rows]
    if any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps):
        sub = _apply_top_k_top_p(sub, top_ks, top_ps)
    probs = torch.softmax(sub, dim=-1)  # [R, vocab]
    min_ps = torch.tensor([params[i].min_p for i in random_rows], device=probs.device)
    if bool((min_ps > 0).any()):
        # Relative to each row's most likely token; the race below needs no renormalisation.
        probs = probs.masked_fill(probs < min_ps[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=generators[i])
    sampled = (probs / noise).argmax(dim=-1)
    greedy_ids[rows] = sampled
    return greedy_ids.tolist()


def mask_constrained(logits: torch.Tensor, constraints: list) -> torch.Tensor:
    """The logits with every token a row's constraint forbids at -inf, on the constrained rows only. A copy: the
    caller's logits stay the model's, which logprobs report (as vLLM does)."""
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


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, vocab]
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    cut = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token is cut when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= torch.tensor(top_ps, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """logits [num_rows, vocab] (the model's, before any processing) -> each row's chosen token's
    log-probability and its num_top most likely alternatives."""
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
