import math

import pytest
import torch

from kvferry.common.errors import InvalidRequest
from kvferry.common.model.sampler import sample
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_TOKEN_IDS, SamplingParams, for_choice


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.5),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=math.nan),
        dict(top_k=-3),
        dict(max_tokens=0),
        dict(max_tokens=-1),
        dict(seed=-1),
        dict(seed=2**63),
        dict(top_k=2**31),
    ],
)
def test_bad_values_are_refused_with_their_name(bad):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**bad)
    assert next(iter(bad)) in str(err.value)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50, generator=gen(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0, top_p=0.5)]
    assert sample(logits, params, [None, None, None]) == logits.argmax(-1).tolist()


def test_vanishing_temperature_is_greedy_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-40)
    assert params.greedy
    assert sample(logits, [params], [gen(0)]) == [1]


def test_seeded_row_is_independent_of_its_batch():
    torch.manual_seed(0)
    vocab = 1000
    mine = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, seed=42)
    alone, g = [], gen(42)
    for _ in range(20):
        alone.extend(sample(mine[None], [params], [g]))
    crowded, g = [], gen(42)
    for step in range(20):
        others = torch.randn(1 + step % 4, vocab)
        logits = torch.cat([others[:1], mine[None], others[1:]])
        ps = [SamplingParams(temperature=0.7)] + [params] + [SamplingParams(top_k=5, seed=step)] * (len(others) - 1)
        gens = [gen(step)] + [g] + [gen(100 + i) for i in range(len(others) - 1)]
        crowded.append(sample(logits, ps, gens)[1])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really sampled


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    g = gen(1)
    seen_k = {sample(logits, [SamplingParams(top_k=2)], [g])[0] for _ in range(300)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # ~[.64, .24, .09, ...]: top_p .8 keeps the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    seen_p = {sample(logits, [SamplingParams(top_p=0.8)], [g])[0] for _ in range(300)}
    assert seen_p == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = gen(7)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams()], [g])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_each_choice_has_a_valid_seed_of_its_own_whatever_the_request_seed():
    """seed 2**63 - 1 with n = 2 once made seed + 1 fail validation inside a worker's step, ending the process."""
    for seed in (0, 7, MAX_SEED - 1, MAX_SEED):
        params = SamplingParams(seed=seed)
        seeds = [for_choice(params, c).seed for c in range(16)]
        assert seeds[0] == seed and len(set(seeds)) == 16
        assert all(0 <= s <= MAX_SEED for s in seeds)


def test_logit_bias_and_stop_token_ids_are_bounded():
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)))
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    SamplingParams(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS)), stop_token_ids=(1,) * 1024)
