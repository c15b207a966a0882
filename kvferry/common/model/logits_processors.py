"""What changes a row's logits before sampling: logit bias, min_tokens, and the repetition penalties, as vLLM and
transformers have them: the repetition penalty covers prompt and output tokens (a positive logit divided by it, a
negative one multiplied); the frequency penalty counts each output occurrence, the presence penalty each distinct one.
"""

import torch


def process_logits(logits: torch.Tensor, seqs: list, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [num_rows, vocab] (one row per seq) -> the logits to sample from; rows that need nothing are shared."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.needs_processing]
    if not rows:
        return logits
    logits = logits.float().clone()  # [N, vocab]
    vocab = logits.shape[-1]
    for i in rows:
        seq, row = seqs[i], logits[i]  # row: [vocab]
        params = seq.params
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], device=row.device)
            row.index_add_(
                0, ids, torch.tensor([float(b) for _, b in params.logit_bias], dtype=row.dtype, device=row.device)
            )
        if len(seq.output_token_ids) < params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            row[torch.tensor(sorted(t for t in stops if t < vocab), dtype=torch.long, device=row.device)] = float(
                "-inf"
            )
        if params.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), device=row.device)
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
        if (params.frequency_penalty or params.presence_penalty) and seq.output_token_ids:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, device=row.device), minlength=vocab)[:vocab]
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits
