"""The exponential race with a draw of exactly 0, and the one-copy staging of a step's host arrays (its packed
layout checked on the CPU, where the packing is optional)."""

import torch

from kvferry.common.model.host_staging import HostStaging
from kvferry.common.model.sampler import exponential_race, sample, stage_sampling
from kvferry.common.sampling import SamplingParams


def test_a_zero_draw_never_lets_a_filtered_token_win():
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.5, 0.0, 0.0, 0.5]])  # 0: filtered (top_k, top_p, min_p, mask)
    noise = torch.tensor([[0.0, 3.0, 1.0, 0.0], [3.0, 0.0, 0.0, 1.0]])  # zeros on exactly the filtered tokens
    assert exponential_race(probs, noise).tolist() == [2, 3]  # 0.3 / 1 beats 0.7 / 3; 0.5 / 1 beats 0.5 / 3
    assert (probs / noise).argmax(dim=-1).tolist() == [0, 1]  # unclamped, 0 / 0 is NaN and NaN wins


def test_a_zero_draw_on_a_kept_token_makes_it_win():
    probs = torch.tensor([[0.0, 0.1, 0.9]])
    noise = torch.tensor([[0.0, 0.0, 1.0]])  # the rarely kept token drew 0: it wins, as an infinitely fast clock
    assert exponential_race(probs, noise).tolist() == [1]


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


def test_sampling_with_packed_parameters_matches_the_unpacked_draw():
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
        staged = stage_sampling(params, staging)
        staging.upload()
        generators = [None if p.greedy else torch.Generator().manual_seed(p.seed) for p in params]
        return sample(logits, params, generators, staged=staged)

    assert draw(packed=True) == draw(packed=False)
    assert draw(packed=True)[0] == logits[0].argmax().item()
