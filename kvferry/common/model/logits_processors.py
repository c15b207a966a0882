"""What changes a row's logits before sampling: logit bias, min_tokens, and the repetition penalties, as vLLM and
transformers have them: the repetition penalty covers prompt and output tokens (a positive logit divided by it, a
negative one multiplied); the frequency penalty counts each output occurrence, the presence penalty each distinct one.

Each processor runs once for all the rows that ask for it, as tensor operations on just the (row, token) entries it
changes; rows sharing a penalty's value are penalised by one operation with it as a scalar, exactly as one row alone
would be (a division by a scalar is not always a division by a tensor of it: on CUDA, a multiplication by its
reciprocal).
"""

import itertools
from collections import defaultdict

import torch

from kvferry.common.model.host_staging import host_tensor


def process_logits(logits: torch.Tensor, seqs: list, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits [num_rows, vocab] (one row per seq) -> the logits to sample from; rows that need nothing are shared."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.needs_processing]
    if not rows:
        return logits
    logits = logits.float().clone()  # [N, vocab]
    _add_bias(logits, [(i, seqs[i].params.logit_bias) for i in rows if seqs[i].params.logit_bias])
    _mask_stops(logits, [(i, _stops(seqs[i], eos_token_ids)) for i in rows if _before_min_tokens(seqs[i])])
    repetition, occurrence = defaultdict(list), defaultdict(list)  # penalty values -> the rows that have them
    for i in rows:
        params = seqs[i].params
        if params.repetition_penalty != 1:
            repetition[params.repetition_penalty].append(i)
        if (params.frequency_penalty or params.presence_penalty) and seqs[i].output_token_ids:
            occurrence[params.frequency_penalty, params.presence_penalty].append(i)
    for penalty, group in repetition.items():
        seen, _ = _occurrences(group, [seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in group], logits)
        picked = logits[seen]  # [num_seen]
        logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    for (frequency, presence), group in occurrence.items():
        seen, counts = _occurrences(group, [seqs[i].output_token_ids for i in group], logits)
        logits[seen] -= frequency * counts + presence * (counts > 0)
    return logits


def _add_bias(logits: torch.Tensor, biases: list[tuple[int, tuple]]) -> None:
    """biases: (row, its (token id, bias) pairs), added in order (a repeated id twice, as index_add_ adds it)."""
    entries = [(row, token, bias) for row, pairs in biases for token, bias in pairs]
    if not entries:
        return
    rows, tokens, values = zip(*entries)
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def _before_min_tokens(seq) -> bool:
    return len(seq.output_token_ids) < seq.params.min_tokens


def _stops(seq, eos_token_ids: tuple[int, ...]) -> set[int]:
    params = seq.params
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def _mask_stops(logits: torch.Tensor, stops: list[tuple[int, set[int]]]) -> None:
    """stops: (row, the token ids it may not draw yet), each set to -inf."""
    vocab = logits.shape[-1]
    entries = [(row, token) for row, tokens in stops for token in tokens if token < vocab]
    if entries:
        rows, tokens = zip(*entries)
        logits[torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)] = float("-inf")


def _occurrences(rows: list[int], token_lists: list[list[int]], logits: torch.Tensor):
    """Where the rows' token lists put their tokens: ((row indices, token ids), counts), one entry per distinct
    (row, token), by row then token id."""
    vocab, device = logits.shape[-1], logits.device
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    offsets = torch.tensor(rows, device=device).repeat_interleave(lengths) * vocab
    flat = host_tensor(list(itertools.chain.from_iterable(token_lists)), torch.long).to(device)
    keys, counts = torch.unique(offsets + flat, return_counts=True)  # sorted: each row's tokens in id order
    return (keys // vocab, keys % vocab), counts
