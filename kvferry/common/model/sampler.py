"""Sampling a batch in which every row has its own parameters.

Random rows draw by the exponential race (argmax of p / Exp(1) noise), which equals
sampling from p. A seeded row draws its noise from its own generator, so its tokens
depend only on its seed and its logits, never on what else shares the batch.
"""
import torch

from kvferry.common.sampling import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [num_rows, vocab] -> one token id per row."""
    greedy_ids = logits.argmax(dim=-1)  # [N]
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy_ids.tolist()
    rows = torch.tensor(random_rows, device=logits.device)
    sub = logits[rows].float()                                                       # [R, vocab]
    sub = sub / torch.tensor([params[i].temperature for i in random_rows], device=sub.device)[:, None]
    top_ks = [params[i].top_k for i in random_rows]
    top_ps = [params[i].top_p for i in random_rows]
    if any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps):
        sub = _apply_top_k_top_p(sub, top_ks, top_ps)
    probs = torch.softmax(sub, dim=-1)                                               # [R, vocab]
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=generators[i])
    sampled = (probs / noise).argmax(dim=-1)
    greedy_ids[rows] = sampled
    return greedy_ids.tolist()


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)                     # [R, vocab]
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
