"""Sampling a batch in which every row has its own parameters, by inverse CDF: one float64 uniform u per random row
per step picks the token where u times the row's kept mass falls in its cumulative distribution.

SAMPLING_STREAM = 4 names what decides a seeded row's tokens, given its logits; changing any of it changes seeded
outputs, so it needs a new stream number, the pinned constants in tests/unit/test_sampler_draws.py, a protocol
version (a prefill and a decode worker must draw the same stream) and a note in docs/operations.md (replay):
- the uniform: uniform(seed, position) = (splitmix64(splitmix64(seed) ^ position) >> 11) * 2**-53, where position
  is the index of the output token being sampled (len(seq.output_token_ids) before it is appended). Extra choices
  draw from seed + i at their parent's position. It is keyed by nothing else, so a seeded request draws the same
  tokens alone or in any batch, through preemption, failover (resume_token_ids) and the prefill→decode handoff.
  Unseeded rows take u from the runner's random.Random(--engine-seed), in step order.
- plain rows (no top_k, top_p or min_p): softmax(logits / T), then a two-level inverse CDF in float64 over the
  vocabulary in token-id order: blocks of BLOCK tokens, then the token inside the block. The weights are the CPU
  kernel's (kernels/cpu/draw_rows.c: e^(x / T - max / T) in float32, summed in float64) on the CPU where it is
  loaded (logits of any float type, as float32); elsewhere (a GPU, no compiler) PyTorch's softmax, whose token is
  the same except where u lands within rounding of a boundary of the cumulative distribution. A row with a NaN or
  +inf logit draws token 0.
- filtered rows: the kept set is a prefix of the order by probability descending, then token id: the first top_k
  tokens, those whose mass before them (float64) is below top_p times the top_k prefix's mass (1 without a top_k;
  top_p = 1 cuts nothing), and those at least min_p times the likeliest token's probability; the likeliest is always
  kept. A row tries up to FILTER_TRIES uniforms (u, then next_uniform of the last): each try is the plain rows'
  draw over the whole row, and the first token the kept set holds is the row's (rejection: a draw from the kept set,
  with no sort). Where none is, the kept set's draw at the next uniform: the kept set in token-id order, in
  float64. On the CPU where it is loaded, kernels/cpu/draw_filtered.c does both (the kept set among the top_k
  likeliest, found by heap, or by radix selection);
  elsewhere PyTorch (the kept set on a torch.topk pre-cut, checked exact per row and widened where it is not, so it
  is always the full sort's). The two differ only where a uniform, or a token's mass before it, lies within
  rounding of a boundary. Stream 4 is stream 3 with the tries, and float64 prefix sums for the cut (stream 3's
  were float32).
A draw never lands on a token of zero mass; a row with no mass at all (a constraint's dead end) returns a valid id.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvferry.common.model.host_staging import HostStaging, Staged
from kvferry.common.sampling import SamplingParams, TokenLogprobs
from kvferry.kernels.cpu import draw_filtered, draw_rows

SAMPLING_STREAM = 4
BLOCK = 512  # tokens per block of the plain rows' two-level inverse CDF
PRE_CUT = 128  # the filtered rows' first candidates (at least, see pre_cut())
FILTER_TRIES = 8  # a filtered row's tries from its whole distribution before its kept set is found (draw_filtered.c)
WIDE = 1024  # the candidates of the rows whose kept set the pre-cut could not prove exact; then the full sort
# The plain rows' draw goes about this many logits at a time (a few MB of temporaries): a whole big batch's float64
# block sums would spill the caches, and past glibc's largest mmap threshold (32 MB) be a fresh mapping, page-faulted
# every step; much smaller chunks cost more in per-operation overhead than they save.
CHUNK_ELEMENTS = 1 << 20
_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A seeded row's uniform in [0, 1) for output position `position`: 53 bits of a hash of (seed, position)."""
    return (_splitmix64(_splitmix64(seed & _M64) ^ position) >> 11) * 2.0**-53


def is_filtered(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def pre_cut(top_ks: list[int]) -> int:
    """The pre-cut's width for filtered rows with these top_ks (0: none): PRE_CUT, or one more than the largest
    top_k up to WIDE, so that a row cut at its top_k can be told from a tie with the first token outside. A row
    with a larger top_k goes on to the full sort. Capped at the vocabulary where it is used."""
    return max(PRE_CUT, max((k for k in top_ks if k <= WIDE), default=0) + 1)


@dataclass
class SamplingTensors:
    """The random rows' parameters and uniforms, staged with a step's host arrays; which path each row takes is
    decided on the host."""

    random_rows: list[int]
    rows: Staged | None  # the random rows' indices; None when every row is random
    temperatures: Staged
    uniforms: Staged  # float64, one per random row
    plain: Staged | None  # indices among the random rows of the plain ones; None when all or none are plain
    filtered: Staged | None  # likewise of the filtered ones (top_k, top_p or min_p)
    num_plain: int
    num_filtered: int
    pre_cut: int  # the filtered rows' pre-cut width (see pre_cut())
    top_ks: Staged | None  # of the filtered rows (0: no top_k); None when there are none
    top_ps: Staged | None
    min_ps: Staged | None  # None when no filtered row has a min_p


def stage_sampling(
    params: list[SamplingParams], uniforms: list[float | None], staging: HostStaging
) -> SamplingTensors | None:
    """uniforms: each row's u (None or anything for a greedy row). None when every row is greedy."""
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return None
    chosen = [params[i] for i in random_rows]
    plain = [j for j, p in enumerate(chosen) if not is_filtered(p)]
    filtered = [j for j, p in enumerate(chosen) if is_filtered(p)]
    mixed = plain and filtered
    kept = [chosen[j] for j in filtered]
    return SamplingTensors(
        random_rows,
        None if len(random_rows) == len(params) else staging.add(random_rows, torch.long),
        staging.add([p.temperature for p in chosen], torch.float32),
        staging.add([float(uniforms[i]) for i in random_rows], torch.float64),
        staging.add(plain, torch.long) if mixed else None,
        staging.add(filtered, torch.long) if mixed else None,
        len(plain),
        len(filtered),
        pre_cut([p.top_k for p in kept]),
        staging.add([p.top_k for p in kept], torch.long) if kept else None,
        staging.add([p.top_p for p in kept], torch.float32) if kept else None,
        staging.add([p.min_p for p in kept], torch.float32) if any(p.min_p > 0 for p in kept) else None,
    )


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uniforms: list[float | None] | None,
    constraints: list | None = None,
    staged: SamplingTensors | None = None,
) -> list[int]:
    """logits [num_rows, vocab] -> one token id per row. uniforms: each random row's u in [0, 1) (see the module
    docstring; None for a greedy row; unused when staged is given). constraints: a ConstraintState or None per row, which limits the row's
    tokens. staged: params' tensors, staged with the step's inputs (default: staged here)."""
    if constraints is not None:
        logits = mask_constrained(logits, constraints)
    if staged is None:
        staging = HostStaging(logits.device)
        staged = stage_sampling(params, uniforms, staging)
        staging.upload()
    if staged is None:
        return greedy_tokens(logits).tolist()
    rows = None if staged.rows is None else staged.rows.tensor
    temperatures, u = staged.temperatures.tensor, staged.uniforms.tensor
    if not staged.num_filtered:
        sampled = _draw_plain_rows(logits, rows, temperatures, u)
    elif not staged.num_plain:
        sampled = _draw_filtered_rows(logits, rows, temperatures, u, staged)
    else:
        plain, filtered = staged.plain.tensor, staged.filtered.tensor
        sampled = torch.empty(len(staged.random_rows), dtype=torch.long, device=logits.device)
        sampled[plain] = _draw_plain_rows(logits, plain if rows is None else rows[plain], temperatures[plain], u[plain])
        sampled[filtered] = _draw_filtered_rows(
            logits, filtered if rows is None else rows[filtered], temperatures[filtered], u[filtered], staged
        )
    if rows is None:
        return sampled.tolist()
    token_ids = greedy_tokens(logits)  # [N]: the greedy rows keep theirs
    token_ids[rows] = sampled
    return token_ids.tolist()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] -> [N] each row's argmax (its first maximal index; a NaN counts as the maximum, as for
    argmax). On the CPU argmax's index-tracking scan is several times slower than a max: the blocks' maxima first,
    then argmax inside the first block holding the row's maximum."""
    N, V = logits.shape
    if logits.device.type != "cpu" or V < 2 * BLOCK or N == 0:
        return logits.argmax(dim=-1)
    whole = V // BLOCK * BLOCK
    blocks = logits[:, :whole].view(N, -1, BLOCK)  # [N, whole / BLOCK, BLOCK]
    maxima = blocks.amax(-1)  # [N, whole / BLOCK]
    if whole < V:  # the tail as one more block
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], dim=1)
    b = maxima.argmax(dim=-1)  # [N] the first block holding the maximum
    in_block = blocks.gather(1, b.clamp_max(blocks.shape[1] - 1)[:, None, None].expand(N, 1, BLOCK))[:, 0]
    token_ids = b * BLOCK + in_block.argmax(dim=-1)
    if whole < V:
        token_ids = torch.where(b == blocks.shape[1], whole + logits[:, whole:].argmax(dim=-1), token_ids)
    return token_ids


def _probs(sub: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """sub [R, vocab] float32 -> softmax(sub / T) per row. A row with no mass at all (every token -inf: a dead end)
    is NaN there; as zeros it draws a valid id."""
    return torch.softmax(sub / temperatures[:, None], dim=-1).nan_to_num_(0.0)


def _rows(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return (logits if rows is None else logits[rows]).float()  # [R, vocab]


def _draw_rows(logits: torch.Tensor, rows: torch.Tensor | None, kernel, by_kernel, by_torch) -> torch.Tensor:
    """Logits' rows `rows` (None: all) drawn on the CPU by a C kernel module (draw_rows, draw_filtered) wherever it
    is loaded: by_kernel(logits, rows), float32 rows in place (no copy of the rows, no [R, vocab] temporaries).
    Other CPU logits (bf16, fp16, strided) go to it as a float32 copy: the same batch's logits are float32 once
    another row's penalty or constraint has been applied (process_logits, mask_constrained), and a row's token must
    not depend on that. Elsewhere by_torch(the rows as float32)."""
    if kernel.handles(logits):
        return by_kernel(logits, rows)
    sub = _rows(logits, rows)
    if sub.device.type == "cpu":
        sub = sub.contiguous()  # a copy only of strided rows
        if kernel.handles(sub):
            return by_kernel(sub, None)
    return by_torch(sub)


def _draw_plain_rows(
    logits: torch.Tensor, rows: torch.Tensor | None, temperatures: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The plain rows' tokens (_draw_rows): draw_rows.c, else _draw_torch."""
    return _draw_rows(
        logits,
        rows,
        draw_rows,
        lambda x, r: draw_rows.draw(x, r, temperatures, u, BLOCK),
        lambda sub: _draw_torch(sub, temperatures, u),
    )


def _draw_filtered_rows(
    logits: torch.Tensor, rows: torch.Tensor | None, temperatures: torch.Tensor, u: torch.Tensor, staged
) -> torch.Tensor:
    """The filtered rows' tokens (_draw_rows): draw_filtered.c, else _draw_filtered of _probs."""
    ks, ps, min_ps = staged.top_ks.tensor, staged.top_ps.tensor, _min_ps(staged)
    return _draw_rows(
        logits,
        rows,
        draw_filtered,
        lambda x, r: draw_filtered.draw(x, r, temperatures, ks, ps, min_ps, u, BLOCK),
        lambda sub: _draw_filtered(_probs(sub, temperatures), ks, ps, min_ps, u, staged),
    )


def _draw_torch(sub: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """_draw_plain of _probs, CHUNK_ELEMENTS logits at a time on the CPU (the temporaries stay in cache and below
    glibc's mmap threshold): each row's draw is its own. On a GPU in one go: a chunk there is only more launches."""
    R, V = sub.shape
    step = max(1, CHUNK_ELEMENTS // V)
    if R <= step or sub.device.type != "cpu":
        return _draw_plain(_probs(sub, temperatures), u)
    return torch.cat(
        [_draw_plain(_probs(sub[i : i + step], temperatures[i : i + step]), u[i : i + step]) for i in range(0, R, step)]
    )


def _min_ps(staged: SamplingTensors) -> torch.Tensor | None:
    return None if staged.min_ps is None else staged.min_ps.tensor


def _pick(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """cum [R, C] float64, non-decreasing; u [R] in [0, 1) -> [R] the first index whose cumulative mass exceeds
    u times the total, which has mass; where the target rounds up to the total, the first index reaching it."""
    total = cum[:, -1:]
    r = torch.searchsorted(cum, u[:, None] * total, right=True)
    r = torch.where(r >= cum.shape[1], torch.searchsorted(cum, total.contiguous(), right=False), r)
    return r[:, 0]


def _draw_plain(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (zeros allowed) -> [R]: the block holding the target, then the token inside it."""
    R, V = probs.shape
    pad = (-V) % BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(R, -1, BLOCK)
    sums = blocks.sum(-1, dtype=torch.float64)  # [R, V / BLOCK]
    cb = sums.cumsum(-1)
    total = cb[:, -1:]
    target = u[:, None] * total
    b = torch.searchsorted(cb, target, right=True)  # [R, 1]
    b = torch.where(b >= cb.shape[1], torch.searchsorted(cb, total.contiguous(), right=False), b)
    # What falls inside the block; at least 0, as the block's own sums round differently from cb's.
    rest = (target - (cb.gather(-1, b) - sums.gather(-1, b))).clamp_min(0.0)
    inner = blocks.gather(1, b[:, :, None].expand(R, 1, BLOCK))[:, 0].double().cumsum(-1)  # [R, BLOCK]
    t = torch.searchsorted(inner, rest, right=True)
    t = torch.where(t >= BLOCK, torch.searchsorted(inner, inner[:, -1:].contiguous(), right=False), t)
    return (b * BLOCK + t)[:, 0]


def _canonical(vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates [R, C] in the order by value descending, then token id ascending, however topk left ties."""
    by_id = idx.argsort(dim=-1)
    vals, idx = vals.gather(-1, by_id), idx.gather(-1, by_id)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), idx.gather(-1, order)


def _kept(vals, ks, ps, min_ps, vocab, full):
    """vals [R, C] in canonical order -> (kept [R, C], exact [R]): the cut, and whether the candidates prove it
    equal to the full sort's (always, when full)."""
    C = vals.shape[1]
    ks = torch.where(ks > 0, ks, vocab).clamp_max(vocab)
    k_in = ks <= C
    ranks = torch.arange(C, device=vals.device)[None, :]
    cum = vals.double().cumsum(-1)
    # Without a top_k the mass is 1 on every path: the full sort's last prefix sum rounds away from 1, which would
    # make the cut near a boundary depend on how wide the candidates were.
    mass_k = torch.where(k_in & (ks < vocab), cum.gather(-1, (ks.clamp_max(C) - 1)[:, None])[:, 0], 1.0)
    out = (ranks >= ks[:, None]) | ((ps < 1)[:, None] & ((cum - vals) >= (ps.double() * mass_k)[:, None]))
    if min_ps is not None:
        out |= vals < min_ps[:, None] * vals[:, :1]
    out[:, 0] = False  # the likeliest token is always kept
    if full:
        return ~out, torch.ones_like(k_in)
    # Exact when the cut needs no token outside (top_k within, or no top_k and the last candidate cut) and no
    # token outside can matter: the last kept token is strictly likelier than the last candidate (no tie with one
    # outside), or the last candidate has no mass (then none outside has any, and a token of no mass is never drawn:
    # a constraint that leaves fewer tokens than top_k, or a tail that underflows, needs no wider candidates).
    last = (ranks * (~out)).amax(-1)  # [R] the last kept rank
    no_tie = (last < C - 1) & (vals.gather(-1, last[:, None])[:, 0] > vals[:, -1])
    exact = (k_in | ((ks == vocab) & out[:, -1])) & (no_tie | (vals[:, -1] == 0))
    return ~out, exact


def _draw_kept(vals, idx, kept, u):
    """The kept candidates' token, drawn in token-id order in float64."""
    by_id = idx.argsort(dim=-1)
    ids = idx.gather(-1, by_id)
    mass = torch.where(kept, vals, 0.0).gather(-1, by_id).double()
    return ids.gather(-1, _pick(mass.cumsum(-1), u)[:, None])[:, 0]


def sort_descending(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [R, V], none negative -> (values, token ids) [R, V] by value descending, then token id: torch's stable
    descending sort. On the CPU a radix sort of the values' bits instead (a non-negative float's bits order as it
    does), two stable passes over 16 bits each, numpy's radix sort, several times faster."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32:
        s = probs.sort(dim=-1, descending=True, stable=True)
        return s.values, s.indices
    # Ascending: by value descending (without the sign bit, -0.0 is 0.0, as the float sort takes it).
    key = np.invert(np.bitwise_and(probs.contiguous().numpy().view(np.uint32), 0x7FFFFFFF))
    halves = key.view(np.uint16)  # each key's two halves side by side, in the machine's byte order
    low, high = (halves[:, 0::2], halves[:, 1::2]) if np.little_endian else (halves[:, 1::2], halves[:, 0::2])
    order = torch.from_numpy(np.argsort(low, axis=-1, kind="stable"))  # numpy's radix sort, 16 bits at a time
    high = torch.from_numpy(high.view(np.int16)).gather(-1, order).numpy().view(np.uint16)  # torch's gather: faster
    idx = order.gather(-1, torch.from_numpy(np.argsort(high, axis=-1, kind="stable")))
    return probs.gather(-1, idx), idx


def _draw_all(vals, idx, kept, u):
    """_draw_kept over the whole vocabulary: idx is a permutation of the token ids, so token-id order is where each
    value came from (a scatter), not a second sort."""
    mass = torch.zeros_like(vals).scatter_(-1, idx, torch.where(kept, vals, 0.0)).double()  # [R, V] by token id
    return _pick(mass.cumsum(-1), u)


def next_uniform(u: float) -> float:
    """A filtered row's uniform for its next try: 53 bits of splitmix64 of u's own 53 bits."""
    return (_splitmix64(int(u * 2.0**53)) >> 11) * 2.0**-53


def _is_kept(probs, tokens, ks, targets, thresholds):
    """probs [R, V], tokens [R] -> [R] whether each token is in its row's kept set: fewer than ks tokens before it
    in canonical order (value descending, then token id), their float64 mass below targets, its own value not below
    thresholds."""
    value = probs.gather(-1, tokens[:, None])  # [R, 1]
    ids = torch.arange(probs.shape[1], device=probs.device)[None, :]
    before = (probs > value) | ((probs == value) & (ids < tokens[:, None]))  # [R, V]
    mass = torch.where(before, probs, 0.0).sum(-1, dtype=torch.float64)
    return (before.sum(-1) < ks) & (mass < targets) & (value[:, 0] >= thresholds)


def _draw_filtered(probs, ks, ps, min_ps, u, staged=None):
    """probs [R, V]; ks [R] (0: none), ps [R] (1: none), min_ps [R] or None -> [R]: FILTER_TRIES tries from the
    whole row, kept where the filters keep the token, then the kept set's draw (_draw_kept_set) at the next uniform
    for the rows that none of their tries settled (kernels/cpu/draw_filtered.c draws the same)."""
    R, V = probs.shape
    ks = torch.where((ks > 0) & (ks < V), ks, V)
    targets = torch.full((R,), float("inf"), dtype=torch.float64, device=probs.device)
    if bool((ps < 1).any()):
        mass_k = torch.ones(R, dtype=torch.float64, device=probs.device)  # without a top_k, as _kept takes it
        cut = ((ks < V) & (ps < 1)).nonzero()[:, 0]
        if len(cut):  # only these rows' topk: a row without a top_k would make it the whole vocabulary's
            mass_k[cut] = _top_k_mass(probs[cut], ks[cut])
        targets = torch.where(ps < 1, ps.double() * mass_k, targets)
    thresholds = probs.amax(-1) * min_ps if min_ps is not None else torch.zeros(R, device=probs.device)
    tokens = torch.zeros(R, dtype=torch.long, device=probs.device)
    pending = (probs.amax(-1) > 0).nonzero()[:, 0]  # a row without mass (NaN, +inf, a dead end): token 0
    us = u.tolist()
    for _ in range(FILTER_TRIES):
        if not len(pending):
            return tokens
        at = pending.tolist()
        drawn = _draw_plain(probs[pending], torch.tensor([us[i] for i in at], dtype=torch.float64, device=u.device))
        kept = _is_kept(probs[pending], drawn, ks[pending], targets[pending], thresholds[pending])
        tokens[pending[kept]] = drawn[kept]
        for i in at:
            us[i] = next_uniform(us[i])
        pending = pending[~kept]
    if not len(pending):
        return tokens
    rest = torch.tensor([us[i] for i in pending.tolist()], dtype=torch.float64, device=u.device)
    sub = tuple(None if t is None else t[pending] for t in (probs, ks, ps, min_ps))
    tokens[pending] = _draw_kept_set(*sub, rest, staged)
    return tokens


def _top_k_mass(probs, ks):
    """[R] the float64 mass of each row's ks likeliest tokens (ks <= V); ties at the edge weigh alike."""
    values = probs.topk(int(ks.max()), dim=-1).values  # [R, max k], descending
    within = torch.arange(values.shape[1], device=probs.device)[None, :] < ks[:, None]
    return torch.where(within, values, 0.0).sum(-1, dtype=torch.float64)


def _draw_kept_set(probs, ks, ps, min_ps, u, staged=None, width=None):
    """probs [R, V]; ks [R] (0: none), ps [R] (1: none), min_ps [R] or None -> [R], drawn over the kept set. width:
    the pre-cut (default pre_cut() of the rows); the kept set, and so the token, is the full sort's whatever the
    width."""
    R, V = probs.shape
    if width is None:
        width = staged.pre_cut if staged is not None else pre_cut(ks.tolist())
    tokens, rows, sub = None, None, (probs, ks, ps, min_ps, u)
    C = min(V, width)
    while True:
        full = C >= V
        if full:
            vals, idx = sort_descending(sub[0])
        else:
            vals, idx = _canonical(*sub[0].topk(C, dim=-1))
        kept, exact = _kept(vals, sub[1], sub[2], sub[3], V, full)
        drawn = _draw_all(vals, idx, kept, sub[4]) if full else _draw_kept(vals, idx, kept, sub[4])
        if rows is None:
            tokens = drawn
        else:
            tokens[rows] = drawn
        if full or bool(exact.all()):
            return tokens
        inexact = (~exact).nonzero()[:, 0]
        rows = inexact if rows is None else rows[inexact]
        sub = tuple(None if t is None else t[inexact] for t in sub)
        wider = min(V, WIDE)
        C = wider if C < wider and not _all_cut_past(vals[inexact], wider, *sub[1:4]) else V


def _all_cut_past(vals, width, ks, ps, min_ps) -> bool:
    """Whether no row of these candidates (canonical order) could have its cut proven within width candidates: no
    top_k or min_p that could cut there, and a top_p that the likeliest width tokens cannot reach (at most the
    candidates' mass and, for each token beyond them, the last one's). A flat distribution's rows: the widening to
    width would only be undone by the full sort. A guess that errs costs time, never a token."""
    if min_ps is not None and bool((min_ps > 0).any()):
        return False
    C = vals.shape[1]
    reach = vals.sum(-1, dtype=torch.float64) + (width - C) * vals[:, -1].double()
    return bool(((ks <= 0) | (ks > width)).all()) and bool((reach < ps.double() * (1 - 1e-3)).all())


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
