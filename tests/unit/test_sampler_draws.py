"""The sampler's draws (sampling stream 4, sampler.py): the pinned stream, by the C kernels and the PyTorch path, the zero-mass edges of the inverse CDF,
the pre-cut's exactness against the full sort (the kept set's draw, where a filtered row's tries end), the kept set against the sort-based cut the sampler had before, the
distributions, batch invariance, dead ends; and the one-copy staging of a step's host arrays (its packed layout
checked on the CPU, where the packing is optional)."""

import pytest
import torch

from kvferry.common.model import sampler
from kvferry.common.model.host_staging import HostStaging
from kvferry.common.model.sampler import (
    SAMPLING_STREAM,
    _draw_kept_set,
    _draw_plain,
    _pick,
    next_uniform,
    sample,
    stage_sampling,
    uniform,
)
from kvferry.common.sampling import SamplingParams
from kvferry.kernels.cpu import draw_filtered, draw_rows

LAST_U = 1 - 2.0**-53  # the largest uniform


@pytest.fixture(params=["kernel", "pytorch"])
def plain_path(request, tmp_path_factory):
    """The draws by the C kernels (the CPU's, where they compile: plain rows and filtered ones) or by the PyTorch
    path (elsewhere)."""
    kernels = (draw_rows, draw_filtered)
    for kernel in kernels:
        if request.param == "kernel":
            assert kernel.enable(tmp_path_factory.mktemp("kernels")) == ""
        else:
            kernel.disable()
    yield request.param
    for kernel in kernels:
        kernel.disable()


def test_the_stream_is_pinned(plain_path):
    """Changing any of these changes every seeded output: bump SAMPLING_STREAM and the protocol version, and say so
    in docs/operations.md (replay), before editing the constants. Both paths draw them (their draws differ only
    within rounding of a boundary: tests/unit/test_draw_rows.py and test_draw_filtered.py)."""
    assert SAMPLING_STREAM == 4
    assert uniform(0, 0) == 0.6524484863740322
    assert uniform(42, 0) == 0.34329192209867343
    assert uniform(42, 1) == 0.9504380907279257
    assert uniform(2**63 - 1, 1000) == 0.6675415439314257
    assert next_uniform(0.95) == 0.4984105020073555
    assert next_uniform(0.0) == 0.8833108082136426
    assert next_uniform(LAST_U) == 0.1434526250083874
    logits = torch.log(torch.tensor([[0.05, 0.3, 0.1, 0.25, 0.2, 0.1]]))
    methods = [SamplingParams(), SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(min_p=0.5)]
    drawn = {u: [sample(logits, [p], [u])[0] for p in methods] for u in (0.12, 0.55, 0.95)}
    # plain: token-id order, cumulative .05 .35 .45 .70 .90 1; top_k 2 and top_p .5 keep {1, 3}; min_p {1, 3, 4}.
    # A filtered row's first try is the plain draw; at 0.95 it is token 5, which none keeps, and the second try's
    # uniform, 0.498..., falls on token 3, which all keep.
    assert drawn == {0.12: [1, 1, 1, 1], 0.55: [3, 3, 3, 3], 0.95: [5, 3, 3, 3]}
    # Three blocks and a tail at temperature 0.7, logits exact in float32 on any machine.
    vocab = 3 * sampler.BLOCK + 7
    logits = (((torch.arange(vocab) * 7919) % 1000).float() / 100 - 5)[None]
    params = SamplingParams(temperature=0.7, seed=42)
    assert [sample(logits, [params], [uniform(42, i)])[0] for i in range(8)] == [
        531, 1459, 680, 1507, 445, 1408, 1161, 138
    ]  # fmt: skip
    # Filtered rows of the same logits: their tries (the positions whose first try is the plain row's token above
    # took it), and top_k 5 among ties, by the kept set's draw where the tries missed.
    filtered = {
        (0.7, 0.9, 0, 0.0): [531, 556, 680, 1507, 445, 1408, 1161, 717],
        (1.5, 1.0, 5, 0.0): [642, 321, 284, 963, 963, 284, 642, 1321],
        (0.7, 0.8, 0, 0.02): [531, 556, 680, 1507, 445, 1408, 1161, 717],
    }
    for (t, top_p, top_k, min_p), want in filtered.items():
        params = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, min_p=min_p, seed=42)
        assert [sample(logits, [params], [uniform(42, i)])[0] for i in range(8)] == want


def test_zero_mass_tokens_are_never_drawn_at_either_end_of_the_uniforms():
    vocab = 3 * sampler.BLOCK + 7  # padded to whole blocks
    probs = torch.rand(1, vocab, generator=torch.Generator().manual_seed(0))
    zero = [0, 1, sampler.BLOCK - 1, sampler.BLOCK, 2 * sampler.BLOCK - 1, 2 * sampler.BLOCK, vocab - 2, vocab - 1]
    probs[0, zero] = 0.0
    probs /= probs.sum()
    first, last = (int(t) for t in torch.nonzero(probs[0])[[0, -1], 0])
    for u, want in ((0.0, first), (LAST_U, last)):
        assert _draw_plain(probs, torch.tensor([u], dtype=torch.float64)).tolist() == [want]
    # A whole block of zeros between two of mass: its edges are never drawn either.
    probs[0, sampler.BLOCK : 2 * sampler.BLOCK] = 0.0
    us = torch.linspace(0, LAST_U, 4001, dtype=torch.float64)
    drawn = _draw_plain(probs.expand(len(us), -1).contiguous(), us)
    assert bool((probs[0, drawn] > 0).all())
    cum = torch.tensor([[0.0, 0.0, 0.5, 0.5, 1.0, 1.0]], dtype=torch.float64)
    assert [_pick(cum, torch.tensor([u], dtype=torch.float64)).item() for u in (0.0, 0.5, LAST_U)] == [2, 4, 4]


def test_a_dead_end_row_returns_a_token_in_range(plain_path):
    """Every token -inf (a constraint allowed none): the scheduler ends the row; the draw must not fail first."""
    logits = torch.full((2, 300), float("-inf"))
    methods = [SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(min_p=0.2)]
    for params in methods:
        for u in (0.0, 0.5, LAST_U):
            assert all(0 <= t < 300 for t in sample(logits, [params, params], [u, u]))


def logits_with_ties(rows, vocab, seed):
    """Random and peaked rows, with runs of equal values around where cuts fall, and a few exact duplicates."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 8, rows)[:, None]
    logits = (logits * 4).round() / 4  # many exact ties
    logits[::3, :40] = logits[::3, :1]  # a run of 40 equal likeliest tokens
    return logits


FILTERS = [
    dict(top_k=1),
    dict(top_k=5),
    dict(top_k=40),
    dict(top_k=300),
    dict(top_k=2000),
    dict(top_p=0.3),
    dict(top_p=0.9),
    dict(top_p=0.99),
    dict(top_k=20, top_p=0.8),
    dict(min_p=0.05),
    dict(top_p=0.95, min_p=0.1),
    dict(top_k=50, top_p=1.0),
]


def filtered_args(probs, params, us):
    ks = torch.tensor([p.top_k for p in params])
    ps = torch.tensor([p.top_p for p in params])
    min_ps = torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
    return probs, ks, ps, min_ps, torch.tensor(us, dtype=torch.float64)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_the_pre_cut_draws_exactly_what_the_full_sort_draws(filters):
    vocab = 3000
    probs = torch.softmax(logits_with_ties(24, vocab, 1), dim=-1)
    params = [SamplingParams(**filters)] * 24
    for position in range(4):
        args = filtered_args(probs, params, [uniform(row, position) for row in range(24)])
        full = _draw_kept_set(*args, width=vocab).tolist()
        assert _draw_kept_set(*args, width=8).tolist() == full  # forces the widening and the sort
        assert _draw_kept_set(*args).tolist() == full  # the default pre-cut


def test_flat_rows_whose_cut_lies_past_the_wide_pre_cut_draw_what_the_full_sort_draws():
    """A nearly flat distribution (a random model's) keeps most of its vocabulary under top_p: such rows go from the
    pre-cut straight to the full sort, alone or beside a peaked row that the wide pre-cut settles."""
    vocab = 3 * sampler.WIDE
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(8)) * 0.2
    logits[5] *= 40  # peaked: its top_p cut falls among the likeliest few hundred
    probs = torch.softmax(logits, dim=-1)
    for params in ([SamplingParams(top_p=0.95)] * 6, [SamplingParams(top_p=0.9), SamplingParams(top_k=2000)] * 3):
        for rows in (slice(0, 5), slice(0, 6)):
            args = filtered_args(probs[rows], params[rows], [uniform(row, 3) for row in range(6)][rows])
            full = _draw_kept_set(*args, width=vocab).tolist()
            assert _draw_kept_set(*args).tolist() == full
            assert _draw_kept_set(*args, width=8).tolist() == full


def sort_based_cut(logits, top_ks, top_ps, min_ps):
    """The sampler's cut before stream 2 (a full sort of the logits), kept as the oracle: the kept tokens [R, V]."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.where(top_ks > 0, top_ks, vocab)
    ranks = torch.arange(vocab)[None, :]
    cut = ranks >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    cut |= mass_before >= top_ps[:, None]
    kept = torch.empty_like(cut).scatter_(-1, order, ~cut)
    if min_ps is not None:
        probs = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
        kept &= probs >= min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
    return kept


def kept_by_sampler(probs, ks, ps, min_ps):
    """The kept set the sampler draws from (stream 2's rule, kept in stream 3): the full sort's (the pre-cut is
    proven equal to it above)."""
    s = probs.sort(dim=-1, descending=True, stable=True)
    kept, _ = sampler._kept(s.values, ks, ps, min_ps, probs.shape[1], True)
    return torch.zeros_like(kept).scatter_(-1, s.indices, kept)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_the_kept_set_is_the_sort_based_cut(filters):
    """The same tokens as the sort-based cut, except at top_p = 1 (top_k or min_p alone): the old float32 cumsum
    could reach 1 early and cut tail tokens of negligible mass though top_p was 1; now top_p = 1 cuts nothing by
    mass (intended)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 5000, generator=g) * torch.linspace(0.5, 6, 64)[:, None]
    params = [SamplingParams(**filters)] * 64
    probs, ks, ps, min_ps, _ = filtered_args(torch.softmax(logits, dim=-1), params, [0.0] * 64)
    mine = kept_by_sampler(probs, ks, ps, min_ps)
    oracle = sort_based_cut(logits, ks, ps, min_ps)
    if params[0].top_p == 1.0:
        assert bool((oracle <= mine).all())  # never cuts more, and what it keeps besides is a negligible tail
        assert float(probs.masked_fill(~(mine & ~oracle), 0.0).sum(-1).max()) < 1e-6
    else:
        assert torch.equal(mine, oracle)


def chi_square(tokens, want):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(want)).double()
    expected = torch.tensor(want, dtype=torch.float64) * len(tokens)
    return float(((counts - expected)[expected > 0] ** 2 / expected[expected > 0]).sum()), counts[expected == 0]


@pytest.mark.parametrize(
    "filters,want",
    [
        (dict(), [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]),
        (dict(top_p=0.79), [0.50, 0.3125, 0.1875, 0, 0, 0]),  # 0.8 is the mass before token 3, within rounding
        (dict(min_p=0.3), [0.50, 0.3125, 0.1875, 0, 0, 0]),
        (dict(top_k=2), [0.40 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
    ],
    ids=["plain", "top_p", "min_p", "top_k"],
)
def test_draws_follow_the_distribution(filters, want, plain_path):
    """A fixed seed's first 20,000 positions (deterministic: it cannot flake). chi-square below the 0.1% point of
    its degrees of freedom, and no token outside the support."""
    draws = 20_000
    logits = torch.log(torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]])).expand(draws, -1).contiguous()
    tokens = sample(logits, [SamplingParams(**filters)] * draws, [uniform(7, i) for i in range(draws)])
    chi2, outside = chi_square(tokens, want)
    limit = {5: 20.5, 2: 13.8, 1: 10.8}[sum(p > 0 for p in want) - 1]
    assert chi2 < limit and not outside.any(), (chi2, outside)


def test_a_row_draws_the_same_alone_in_any_batch_and_on_any_thread_count(plain_path):
    vocab = 4000
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.8, top_p=0.95, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(min_p=0.1, seed=4),
        SamplingParams(top_k=2000, seed=5),  # past the pre-cut and the widening: the full sort
        SamplingParams(temperature=1.3, top_k=40, seed=6),
        SamplingParams(temperature=0.5),
        SamplingParams(top_p=0.5, seed=8),
    ]
    us = [None if p.greedy else uniform(p.seed or 0, 17) for p in params]
    alone = [sample(logits[i : i + 1], [p], [u])[0] for i, (p, u) in enumerate(zip(params, us))]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert sample(logits, params, us) == alone
            order = [8, 3, 0, 6, 2, 5, 1, 7, 4]
            assert sample(logits[order], [params[i] for i in order], [us[i] for i in order]) == [
                alone[i] for i in order
            ]
    finally:
        torch.set_num_threads(threads)


def test_plain_rows_drawn_a_few_at_a_time_draw_what_each_draws_alone(monkeypatch):
    """A batch's plain rows go through the draw in chunks of rows (CHUNK_ELEMENTS logits each, here 3 rows): every
    row draws its own token whichever chunk it falls in, at either end of the uniforms too."""
    draw_rows.disable()  # the chunks are the PyTorch path's
    vocab = 3 * sampler.BLOCK + 11
    monkeypatch.setattr(sampler, "CHUNK_ELEMENTS", 3 * vocab)
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(5)) * 2
    logits[4] = float("-inf")  # a dead end among them
    params = [SamplingParams(temperature=0.5 + 0.1 * i, seed=i) for i in range(10)]
    us = [uniform(i, 3) for i in range(9)] + [LAST_U]
    alone = [sample(logits[i : i + 1], [p], [u])[0] for i, (p, u) in enumerate(zip(params, us))]
    assert sample(logits, params, us) == alone
    mixed = [SamplingParams(temperature=0) if i % 4 == 1 else p for i, p in enumerate(params)]
    assert sample(logits, mixed, us)[::4] == alone[::4]


def test_the_full_sort_orders_as_torchs_stable_descending_sort():
    """The CPU's radix sort of the probabilities' bits: by value descending, ties by token id, zeros and all."""
    probs = torch.softmax(torch.randn(6, 3000, generator=torch.Generator().manual_seed(2)) * 4, dim=-1)
    probs = (probs * 2**12).round() / 2**12  # many ties, and many zeros at the tail
    probs[1] = 0.0
    probs[2, ::7] = probs[2, 0]
    probs[3, 5::9] = -0.0  # a zero by another name
    want = probs.sort(dim=-1, descending=True, stable=True)
    vals, idx = sampler.sort_descending(probs)
    assert torch.equal(idx, want.indices) and torch.equal(vals, want.values)
    assert torch.equal(sampler.sort_descending(probs[1:4])[1], want.indices[1:4])  # rows alone as in the batch


def test_staged_parts_pack_into_one_buffer_of_the_same_values():
    staging = HostStaging(torch.device("cpu"), packed=True)
    parts = [
        staging.add([3, -1, 2**40], torch.long),
        staging.add([7, 8, 9, 10, 11, 12], torch.int32, (2, 3)),
        staging.add([], torch.int32),
        staging.add([0.5, 1.25, -2.0], torch.float32),
        staging.add([1], torch.int32),
    ]
    staging.upload()
    base = parts[0].tensor.untyped_storage().data_ptr()
    assert all(p.tensor.untyped_storage().data_ptr() == base for p in parts)  # one buffer: one copy to a device
    for part in parts:
        assert (
            part.tensor.dtype == part.dtype
            and part.tensor.tolist() == torch.tensor(part.values).view(part.shape).tolist()
        )
    assert parts[1].tensor.shape == (2, 3)


def test_sampling_with_packed_parameters_matches_the_unpacked_draw(plain_path):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, seed=1),
        SamplingParams(temperature=1.3, top_p=0.6, min_p=0.1, seed=2),
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.2, seed=3),
    ]

    def draw(packed: bool) -> list[int]:
        staging = HostStaging(torch.device("cpu"), packed=packed)
        staged = stage_sampling(params, uniforms, staging)
        staging.upload()
        return sample(logits, params, None, staged=staged)

    uniforms = [None if p.greedy else uniform(p.seed, 3) for p in params]

    assert draw(packed=True) == draw(packed=False) == sample(logits, params, uniforms)
    assert draw(packed=True)[0] == logits[0].argmax().item()


def test_without_a_top_k_the_cut_at_a_boundary_does_not_depend_on_the_candidates():
    """No top_k: the mass is 1 on every path. The full sort's last prefix sum rounds away from 1, so taking it
    instead cut this row's top_p boundary (top_p one float32 step from a prefix mass) differently at width 3,000."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, 3000, generator=g) * 3, -1)
    ps, u, ks = torch.tensor([0.5339059829711914]), torch.tensor([0.3115], dtype=torch.float64), torch.tensor([0])
    assert _draw_kept_set(probs, ks, ps, None, u).item() == _draw_kept_set(probs, ks, ps, None, u, width=3000).item()


def test_a_row_whose_candidates_end_in_zero_mass_needs_no_wider_candidates():
    """A constraint that leaves 3 tokens under top_k 40: every token past them has no mass and is never drawn, so
    the pre-cut is exact (it used to widen to 1,024 and then sort the whole vocabulary, every step)."""
    probs = torch.zeros(1, 3000)
    probs[0, :3] = torch.tensor([0.5, 0.3, 0.2])
    vals, _ = probs.topk(128)
    assert sampler._kept(vals, torch.tensor([40]), torch.tensor([1.0]), None, 3000, False)[1].item()
