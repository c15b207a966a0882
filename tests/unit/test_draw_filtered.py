"""The filtered rows' draw (sampling stream 4, sampler.py), by the C kernel (kernels/cpu/draw_filtered.c) and by the
PyTorch path, against an oracle in float64 written from the stream's rule: a row's tries from its whole distribution,
the first token its kept set holds, else the kept set's own draw at the next uniform. Peaked and flat rows, ties,
top_k, top_p, min_p and their mixes, the tries' end (a flat row under a small top_k), rows of one token's mass and
dead ends."""

import pytest
import torch

from kvferry.common.model import sampler
from kvferry.common.model.sampler import BLOCK, FILTER_TRIES, next_uniform, sample, uniform
from kvferry.common.sampling import SamplingParams
from kvferry.kernels.cpu import draw_filtered

# How far (a fraction of the row's mass) a uniform, or a token's mass before it, may lie from a boundary where a
# path and the oracle disagree: the paths round e^(x / T) in float32 each in its own way.
NEAR = 1e-6


@pytest.fixture(params=["kernel", "pytorch"])
def path(request, tmp_path_factory):
    if request.param == "kernel":
        assert draw_filtered.enable(tmp_path_factory.mktemp("kernels")) == ""
    else:
        draw_filtered.disable()
    yield request.param
    draw_filtered.disable()


def oracle(logits: torch.Tensor, t: float, k: int, p: float, min_p: float, u: float):
    """(the stream's token for this row, whether the uniform or the cut came within NEAR of a boundary)."""
    probs = torch.softmax(logits.double() / t, dim=-1)
    V = probs.shape[0]
    order = sorted(range(V), key=lambda i: (-float(probs[i]), i))  # the canonical order
    sorted_p = probs[order]
    before = sorted_p.cumsum(0) - sorted_p
    k = k if 0 < k < V else V
    mass_k = float(sorted_p[:k].sum()) if k < V else 1.0
    target = p * mass_k if p < 1 else float("inf")
    threshold = min_p * float(sorted_p[0])
    kept_rank = (torch.arange(V) < k) & (before < target) & (sorted_p >= threshold)
    kept_rank[0] = True
    near = bool(((before - target).abs() < NEAR).any()) or bool(((sorted_p - threshold).abs() < NEAR).any())
    kept = torch.zeros(V, dtype=torch.bool)
    kept[order] = kept_rank

    def inverse_cdf(weights, u):
        cum = weights.cumsum(0)
        nonlocal near
        near |= bool(((cum - u * cum[-1]).abs() < NEAR).any())
        return int(torch.searchsorted(cum, u * cum[-1], right=True).clamp_max(V - 1))

    for _ in range(FILTER_TRIES):
        token = inverse_cdf(probs, u)
        u = next_uniform(u)
        if kept[token]:
            return token, near
    return inverse_cdf(torch.where(kept, probs, 0.0), u), near


FILTERS = [
    dict(top_p=0.95),
    dict(top_p=0.5),
    dict(top_k=1),
    dict(top_k=3),  # a flat row's tries all miss: the kept set's draw
    dict(top_k=50),
    dict(top_k=20, top_p=0.8),
    dict(min_p=0.05),
    dict(top_p=0.9, min_p=0.1),
    dict(top_k=100_000, top_p=0.99),  # a top_k past the vocabulary cuts nothing
    dict(top_k=1100, top_p=0.9),  # past the kernel's heap (HEAP_K, 1,024): its radix selection
    dict(top_k=1100, min_p=0.2),
    # Kept sets that a flat row's tries mostly miss: the kept set's draw, by radix selection on the mass (top_p), on
    # the count (min_p), and on both, under a top_k past the heap.
    dict(top_p=0.01),
    dict(min_p=0.99),
    dict(top_k=1100, top_p=0.01),
]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_each_path_draws_the_oracles_token(path, filters):
    vocab, rows = 2 * BLOCK + 77, 24
    g = torch.Generator().manual_seed(len(str(filters)))
    scales = torch.tensor([0.05, 0.3, 1.0, 3.0, 8.0, 30.0]).repeat(rows // 6)
    logits = torch.randn(rows, vocab, generator=g) * scales[:, None]
    logits[::5] = (logits[::5] * 2).round() / 2  # runs of exact ties
    params = [SamplingParams(temperature=0.4 + 0.1 * (r % 7), seed=r, **filters) for r in range(rows)]
    us = [uniform(r, 9) for r in range(rows)]
    drawn = sample(logits, params, us)
    mismatches = []
    for r, prm in enumerate(params):
        want, near = oracle(logits[r], prm.temperature, prm.top_k, prm.top_p, prm.min_p, us[r])
        if drawn[r] != want:
            mismatches.append(r)
            assert near, (r, drawn[r], want)  # only at a boundary
    assert len(mismatches) <= 1, mismatches


def test_the_kernel_and_the_pytorch_path_agree_across_a_batch(tmp_path):
    """Flat to peaked rows under every filter at once, each with its own parameters: the same tokens."""
    vocab, rows = 5000, 96
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.05, 12, rows)[:, None]
    params = [SamplingParams(temperature=0.3 + (r % 5) * 0.3, seed=r, **FILTERS[r % len(FILTERS)]) for r in range(rows)]
    us = [uniform(r, 2) for r in range(rows)]
    assert draw_filtered.enable(tmp_path) == ""
    try:
        mine = sample(logits, params, us)
    finally:
        draw_filtered.disable()
    theirs = sample(logits, params, us)
    assert sum(a != b for a, b in zip(mine, theirs)) <= 1


def test_a_flat_row_under_a_small_top_k_ends_its_tries_in_the_kept_set(path):
    """Three tokens of 2,000 equally likely: each try keeps its token with a chance of 3 in 2,000, so the row's token
    comes from the kept set's draw, at the uniform after the last try's: one of the three ids a flat row keeps (the
    lowest, as ties go by id), in proportion to the uniform."""
    logits = torch.zeros(3, 2000)
    us = [0.1, 0.5, 0.9]
    drawn = sample(logits, [SamplingParams(top_k=3)] * 3, us)
    after = []
    for u in us:
        for _ in range(FILTER_TRIES):
            u = next_uniform(u)
        after.append(int(u * 3))
    assert drawn == after


def test_rows_without_mass_or_with_one_token_of_mass(path):
    logits = torch.full((4, 700), float("-inf"))
    logits[1, 345] = 2.0  # one token of mass: every filter keeps it
    logits[2, 0] = float("nan")  # a NaN: token 0, as the plain rows
    logits[3, :] = 0.0
    logits[3, 699] = float("inf")  # +inf: no mass either
    for filters in FILTERS:
        if SamplingParams(**filters).greedy:
            continue  # top_k 1: the argmax, +inf's token
        drawn = sample(logits, [SamplingParams(**filters)] * 4, [0.3, 0.99, 0.5, 0.7])
        assert drawn[1] == 345 and drawn[2] == 0 and drawn[3] == 0 and 0 <= drawn[0] < 700, (filters, drawn)


def test_only_what_the_filters_keep_is_drawn(path):
    """Many positions of one peaked and one flat row: every token within the row's kept set."""
    g = torch.Generator().manual_seed(11)
    logits = torch.stack([torch.randn(3000, generator=g) * 6, torch.randn(3000, generator=g) * 0.1])
    for filters in FILTERS[:6]:
        params = [SamplingParams(**filters)] * 2
        probs = torch.softmax(logits.double(), -1)
        for position in range(40):
            us = [uniform(7, position), uniform(8, position)]
            for r, token in enumerate(sample(logits, params, us)):
                s = probs[r].sort(descending=True, stable=True)
                rank = int((s.indices == token).nonzero())
                k = filters.get("top_k") or 3000
                assert rank < k, (filters, r, rank)
                mass_k = float(s.values[:k].sum()) if k < 3000 else 1.0
                assert float(s.values[:rank].sum()) < filters.get("top_p", 1.0) * mass_k + NEAR or rank == 0


def test_the_kernel_refuses_parameters_of_the_wrong_kind(tmp_path):
    assert draw_filtered.enable(tmp_path) == ""
    try:
        logits = torch.randn(2, 600)
        t, u = torch.ones(2), torch.zeros(2, dtype=torch.float64)
        ks, ps = torch.zeros(2, dtype=torch.long), torch.ones(2)
        with pytest.raises(AssertionError):
            draw_filtered.draw(logits, None, t, ks.int(), ps, None, u, BLOCK)  # top_ks must be int64
        with pytest.raises(AssertionError):
            draw_filtered.draw(logits, None, t, ks, ps, None, u[:1], BLOCK)  # one uniform a row
        assert not draw_filtered.handles(logits.half()) and not draw_filtered.handles(logits.t())
    finally:
        draw_filtered.disable()


def test_without_the_kernel_the_filtered_rows_take_the_pytorch_path():
    draw_filtered.disable()
    assert not draw_filtered.handles(torch.zeros(1, 10))
    logits = torch.log(torch.tensor([[0.05, 0.3, 0.1, 0.25, 0.2, 0.1]]))
    assert sampler.sample(logits, [SamplingParams(top_p=0.5)], [0.95]) == [3]


def test_min_p_of_one_keeps_every_token_tied_with_the_likeliest(path):
    """The threshold is min_p times the likeliest token's weight as the row's weights have it: a scalar exponential
    of the maximum rounded above the tied tokens' own weights once, and min_p 1 kept none of them in the tries."""
    logits = torch.full((1, 700), -5.0)
    logits[0, [157, 300]] = 11.5
    params = SamplingParams(temperature=0.30628502368927, min_p=1.0, top_k=2, seed=3)
    drawn = {sample(logits, [params], [uniform(3, position)])[0] for position in range(200)}
    assert drawn == {157, 300}


def test_rows_that_often_end_their_tries_still_draw_the_kept_distribution(path):
    """top_k 2 keeps 0.24 of this row: 0.76^8, about one draw in nine, misses all its tries and draws from the kept
    set itself. Tries and kept-set draws together: chi-square (1 degree of freedom) below its 0.1% point, 10.8, over
    a fixed seed's first 20,000 positions (deterministic: it cannot flake), and nothing outside the two tokens."""
    probs = torch.tensor([0.14, 0.10, 0.095, 0.095, 0.095, 0.095, 0.095, 0.095, 0.095, 0.095])
    draws = 20_000
    logits = probs.log()[None].expand(draws, -1).contiguous()
    tokens = torch.tensor(sample(logits, [SamplingParams(top_k=2)] * draws, [uniform(5, i) for i in range(draws)]))
    counts = torch.bincount(tokens, minlength=10).double()
    expected = torch.tensor([0.14, 0.10], dtype=torch.float64) / 0.24 * draws
    assert counts[2:].sum() == 0
    assert float(((counts[:2] - expected) ** 2 / expected).sum()) < 10.8
