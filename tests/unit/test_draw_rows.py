"""The plain rows' draw in C (kernels/cpu/draw_rows.c) against the PyTorch path (sampler._draw_torch): the same token
except where the uniform falls within rounding of a boundary of the row's distribution, never a token of zero mass,
the PyTorch path's answers for rows without mass, and the sampler's row subsets; without a compiler, the PyTorch
path."""

import pytest
import torch

from kvferry.common.model import sampler
from kvferry.common.model.sampler import BLOCK, sample, uniform
from kvferry.common.sampling import SamplingParams
from kvferry.kernels.cpu import draw_rows

LAST_U = 1 - 2.0**-53  # the largest uniform
# How far (a fraction of the row's mass) a uniform may lie from a boundary where the two paths disagree: each rounds
# e^(x / T) in float32 in its own way, which moves a boundary by about 1e-7 of the mass at most.
NEAR = 1e-6


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kernels")
    assert draw_rows.enable(folder) == ""
    yield folder
    draw_rows.disable()


def both(logits, temperatures, us, rows=None):
    """(the kernel's tokens, the PyTorch path's) for these rows of logits."""
    t, u = torch.tensor(temperatures, dtype=torch.float32), torch.tensor(us, dtype=torch.float64)
    idx = None if rows is None else torch.tensor(rows)
    mine = draw_rows.draw(logits, idx, t, u, BLOCK)
    theirs = sampler._draw_torch(logits if idx is None else logits[idx], t, u)
    return mine.tolist(), theirs.tolist()


def assert_same_but_at_boundaries(logits, temperatures, us, mine, theirs):
    """Every disagreement: the uniform within NEAR of the exact (float64) cumulative mass at the lower token's end."""
    mismatches = [r for r in range(len(mine)) if mine[r] != theirs[r]]
    for r in mismatches:
        cum = torch.softmax(logits[r].double() / temperatures[r], dim=-1).cumsum(-1)
        assert abs(us[r] - float(cum[min(mine[r], theirs[r])])) < NEAR, (r, mine[r], theirs[r], us[r])
    assert len(mismatches) <= max(1, len(mine) // 100)  # and rare


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (300, 5000), (40, 3 * BLOCK + 7), (64, 49152), (50, 100)])
def test_the_kernel_draws_the_pytorch_paths_token_but_within_rounding_of_a_boundary(kernel, rows, vocab):
    g = torch.Generator().manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=g) * torch.linspace(0.5, 6, rows)[:, None]
    temperatures = (torch.rand(rows, generator=g) * 1.5 + 0.1).tolist()
    us = torch.rand(rows, generator=g, dtype=torch.float64).tolist()
    us[0] = 0.0
    us[-1] = LAST_U
    mine, theirs = both(logits, temperatures, us)
    assert all(0 <= t < vocab for t in mine)
    assert_same_but_at_boundaries(logits, temperatures, us, mine, theirs)


def test_the_uniforms_near_each_boundary_land_on_one_side_or_the_other(kernel):
    """Uniforms a hair either side of each exact boundary of a small row: the kernel picks one of the two tokens
    that meet there, as the PyTorch path does."""
    logits = torch.randn(1, 2 * BLOCK + 3, generator=torch.Generator().manual_seed(4)) * 2
    cum = torch.softmax(logits[0].double(), -1).cumsum(-1)
    for j in list(range(0, 2 * BLOCK + 2, 97)) + [BLOCK - 1, BLOCK, 2 * BLOCK - 1]:
        for u in (float(cum[j]) - 1e-9, float(cum[j]) + 1e-9):
            mine, theirs = both(logits, [1.0], [u])
            assert mine[0] in (j, j + 1) and theirs[0] in (j, j + 1)


def test_masked_tokens_are_never_drawn(kernel):
    """-inf (a constraint's mask) weighs nothing at either end of the uniforms and at block edges."""
    vocab = 4 * BLOCK + 5
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, vocab, generator=g) * 3
    logits[torch.rand(8, vocab, generator=g) < 0.9] = float("-inf")
    logits[:, : BLOCK + 1] = float("-inf")  # a whole block and more with no mass
    logits[:, -3:] = float("-inf")
    us = torch.linspace(0, LAST_U, 501, dtype=torch.float64).tolist()
    for r in range(8):
        row = logits[r : r + 1].expand(len(us), -1)
        mine, theirs = both(row, [0.7] * len(us), us)
        assert all(logits[r, t] > float("-inf") for t in mine)
        finite = torch.nonzero(logits[r] > float("-inf"))[:, 0]
        assert mine[0] == theirs[0] == int(finite[0]) and mine[-1] == theirs[-1] == int(finite[-1])


def test_rows_without_mass_give_the_pytorch_paths_token(kernel):
    """A dead end (every token -inf), a NaN, +inf, or x / T past float's range: token 0, as the PyTorch path."""
    vocab = 3 * BLOCK + 7
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2))
    logits[0] = float("-inf")
    logits[1, 700] = float("nan")
    logits[2, vocab - 1] = float("nan")
    logits[3, 5] = float("inf")
    logits[4, 9] = 3e38
    for u in (0.0, 0.5, LAST_U):
        mine, theirs = both(logits, [1.0, 1.0, 1.0, 1.0, 0.5], [u] * 5)
        assert mine == theirs == [0] * 5


def test_a_row_whose_logits_over_t_pass_2_to_the_31_still_draws_a_token_of_mass(kernel):
    """|x / T| past about 2**31 (logits of 3e4 at T = 1e-5): the fused multiply-add's x / T - max / T of the
    likeliest tokens is off by up to half a float's spacing there, over 88, beyond exp_in_range's range. It gave
    garbage weights, a NaN sum and token 0 (here masked); the PyTorch path draws the argmax."""
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    logits[:32] += 3e4
    logits[32:] -= 3e4
    logits[:, 0] = float("-inf")  # a constraint's mask
    for u in (0.0, 0.5, LAST_U):
        mine, theirs = both(logits, [1e-5] * 64, [u] * 64)
        assert mine == theirs == logits.argmax(-1).tolist()


@pytest.mark.parametrize("position", [0, BLOCK - 1, BLOCK, 2 * BLOCK + 6])
def test_a_row_with_one_finite_token_always_draws_it(kernel, position):
    logits = torch.full((3, 2 * BLOCK + 7), float("-inf"))
    logits[:, position] = torch.tensor([-80.0, 0.0, 50.0])
    for u in (0.0, 0.3, LAST_U):
        mine, theirs = both(logits, [0.05, 1.0, 2.0], [u] * 3)
        assert mine == theirs == [position] * 3


def test_a_row_draws_the_same_alone_in_a_batch_as_a_subset_strided_and_on_any_thread_count(kernel):
    vocab = 5 * BLOCK + 3
    wide = torch.randn(300, vocab + 13, generator=torch.Generator().manual_seed(6)) * 3
    logits = wide[:, :vocab]  # rows vocab + 13 floats apart
    assert draw_rows.handles(logits) and not logits.is_contiguous()
    temperatures = [0.5 + (i % 7) * 0.2 for i in range(300)]
    us = [uniform(i, 5) for i in range(300)]
    alone = [both(logits[i : i + 1], temperatures[i : i + 1], us[i : i + 1])[0][0] for i in range(300)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert both(logits, temperatures, us)[0] == alone
            rows = [299, 3, 150, 3, 0]
            assert both(logits, [temperatures[i] for i in rows], [us[i] for i in rows], rows)[0] == [
                alone[i] for i in rows
            ]
    finally:
        torch.set_num_threads(threads)


def test_the_sampler_draws_plain_rows_by_the_kernel_beside_greedy_and_filtered_rows(kernel):
    """sample(): greedy rows keep their argmax, plain rows the kernel's token (each as it draws alone), filtered
    rows the PyTorch path's, in any mix."""
    vocab = 4000
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, seed=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=0),
        SamplingParams(min_p=0.1, seed=4),
    ]
    us = [None if p.greedy else uniform(p.seed or 9, 4) for p in params]
    drawn = sample(logits, params, us)
    plain = [0, 2, 4]
    assert [drawn[i] for i in plain] == both(logits, [params[i].temperature for i in plain], [us[i] for i in plain],
                                             plain)[0]  # fmt: skip
    assert drawn[1] == int(logits[1].argmax()) and drawn[5] == int(logits[5].argmax())
    draw_rows.disable()  # the same mix by the PyTorch path: the filtered rows alike, the plain ones but at a boundary
    try:
        assert [drawn[i] for i in (1, 3, 5, 6)] == [sample(logits, params, us)[i] for i in (1, 3, 5, 6)]
    finally:
        assert draw_rows.enable(kernel) == ""


def test_a_cpu_batch_in_bfloat16_or_strided_draws_as_its_float32_copy(kernel):
    """A bf16 CPU model's logits, and the same rows once another row's penalty or constraint made the batch a float32
    copy (process_logits, mask_constrained): the same tokens, so a row's token does not depend on its batch. The
    bf16 logits took the PyTorch path, the copy the kernel's: near a boundary they differed."""
    x = (torch.randn(1, 600, generator=torch.Generator().manual_seed(1)) * 3 + 100).to(torch.bfloat16)
    cum = torch.softmax(x[0].double() / 0.5, -1).cumsum(-1)
    us = [min(float(c) + k * 2e-7, LAST_U) for c in cum[cum < 1 - 1e-6][-30:] for k in range(-10, 11)]
    n = len(us)
    params = [SamplingParams(temperature=0.5, seed=1)] * n
    floated = sample(x.float().expand(n, -1), params, us)
    assert sample(x.expand(n, -1), params, us) == floated
    strided = torch.zeros(n, 600, 2)
    strided[:, :, 0] = x.float()
    assert strided[:, :, 0].stride(1) == 2 and sample(strided[:, :, 0], params, us) == floated


def test_without_a_compiler_the_pytorch_path_draws(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent-cc")
    draw_rows.disable()
    try:
        assert "/nonexistent-cc" in draw_rows.enable(tmp_path / "elsewhere")
        logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(7))
        assert not draw_rows.handles(logits)
        params = [SamplingParams(temperature=0.7, seed=i) for i in range(3)]
        us = [uniform(i, 0) for i in range(3)]
        t, u = torch.tensor([0.7] * 3), torch.tensor(us, dtype=torch.float64)
        assert sample(logits, params, us) == sampler._draw_torch(logits, t, u).tolist()
    finally:
        monkeypatch.delenv("CC")
        assert draw_rows.enable(kernel) == ""
