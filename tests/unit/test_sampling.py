import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from kvferry.common.errors import InvalidRequest
from kvferry.common.model import sampler
from kvferry.common.model.logits_processors import process_logits
from kvferry.common.model.sampler import sample, uniform
from kvferry.common.sampling import MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_TOKEN_IDS, SamplingParams, for_choice


def gen(seed):
    return torch.Generator().manual_seed(seed)


def stream(seed):
    """A seeded row's uniforms, output position after output position (sampler.py)."""
    return (uniform(seed, position) for position in itertools.count())


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.5),
        dict(temperature=math.nan),
        dict(temperature=math.inf),
        dict(temperature=1e5),
        dict(temperature=1e39),
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


def test_greedy_rows_of_a_wide_vocabulary_take_the_first_maximal_index_as_argmax_does():
    """On the CPU a wide row's argmax goes by its blocks' maxima: the same index wherever the maximum is (ties: the
    first; a NaN counts as the maximum), in the tail past the last whole block too."""
    vocab = 5 * sampler.BLOCK + 37
    logits = (torch.randn(8, vocab, generator=gen(1)) * 2).round()  # many ties, across blocks too
    logits[1, -5:] = 100.0  # the maximum in the tail, several times
    logits[2, [7, sampler.BLOCK + 3]] = 100.0  # tied maxima in two blocks
    logits[3, [sampler.BLOCK * 2 + 1, 40]] = float("nan")
    logits[4] = float("-inf")
    logits[5, -1] = float("nan")
    params = [SamplingParams(temperature=0)] * len(logits)
    want = logits.argmax(-1).tolist()
    assert sample(logits, params, [None] * len(logits)) == want
    assert want[1:6] == [vocab - 5, 7, 40, 0, vocab - 1]
    assert sampler.greedy_tokens(logits[:0]).tolist() == []  # no rows: no tokens, as argmax


def test_vanishing_temperature_is_greedy_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(temperature=1e-40)
    assert params.greedy
    assert sample(logits, [params], [next(stream(0))]) == [1]


def test_seeded_row_is_independent_of_its_batch():
    torch.manual_seed(0)
    vocab = 1000
    mine = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, seed=42)
    alone, g = [], stream(42)
    for _ in range(20):
        alone.extend(sample(mine[None], [params], [next(g)]))
    crowded, g = [], stream(42)
    for step in range(20):
        others = torch.randn(1 + step % 4, vocab)
        logits = torch.cat([others[:1], mine[None], others[1:]])
        ps = [SamplingParams(temperature=0.7)] + [params] + [SamplingParams(top_k=5, seed=step)] * (len(others) - 1)
        us = [next(stream(step))] + [next(g)] + [next(stream(100 + i)) for i in range(len(others) - 1)]
        crowded.append(sample(logits, ps, us)[1])
    assert alone == crowded
    assert len(set(alone)) > 1  # it really sampled


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    g = stream(1)
    seen_k = {sample(logits, [SamplingParams(top_k=2)], [next(g)])[0] for _ in range(300)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits[0], -1)  # ~[.64, .24, .09, ...]: top_p .8 keeps the first two
    assert probs[0] < 0.8 < probs[0] + probs[1]
    seen_p = {sample(logits, [SamplingParams(top_p=0.8)], [next(g)])[0] for _ in range(300)}
    assert seen_p == {0, 1}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = stream(7)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams()], [next(g)])[0]] += 1
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


# -- the logit processors and min_p against formula references --------------------------------------------------
def reference_processed(row: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's and OpenAI's semantics, element by element: logit bias first; then the repetition penalty on every
    token of the prompt or the output (a positive logit divided by it, a negative one multiplied); then the
    frequency penalty once per occurrence in the output and the presence penalty once per distinct output token."""
    out = list(row)
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        out[token] = (
            out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
        )
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out


def seq(params: SamplingParams, prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(params=params, prompt_token_ids=prompt, output_token_ids=output)


# Positive, negative and zero logits; token 3 comes four times in the output, 5 once, 7 only in the prompt.
ROW = [2.0, -1.5, 0.75, 3.0, -2.25, 1.25, 0.0, -0.5, 4.0, -3.0, 0.5, 1.0]
PROMPT, OUTPUT = [7, 9, 3], [3, 5, 3, 3, 6, 3]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-0.75, frequency_penalty=-0.25),  # negative: repeats encouraged
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.5),  # below 1: seen tokens made more likely, negatives halved
        SamplingParams(repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=1.0),
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, logit_bias=((9, 5.0), (3, -4.5), (1, 2.0))),
    ],
    ids=["presence", "frequency", "negative", "repetition", "repetition<1", "all three", "with bias"],
)
def test_penalties_give_exactly_the_reference_logits(params):
    logits = torch.tensor([ROW])
    got = process_logits(logits, [seq(params, PROMPT, OUTPUT)], eos_token_ids=(0,))
    want = reference_processed(ROW, params, PROMPT, OUTPUT)
    assert torch.allclose(got[0], torch.tensor(want), rtol=1e-6, atol=1e-6), (got[0].tolist(), want)
    assert logits[0].tolist() == ROW  # the model's logits stay as they were (logprobs report them)
    untouched = [t for t in range(len(ROW)) if t not in set(PROMPT) | set(OUTPUT) and t not in dict(params.logit_bias)]
    assert got[0, untouched].tolist() == [ROW[t] for t in untouched]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    params = SamplingParams(repetition_penalty=1.6)
    got = process_logits(torch.tensor([ROW]), [seq(params, [8, 4, 6], [9, 2])], eos_token_ids=())[0]
    assert got[8].item() == pytest.approx(4.0 / 1.6) and got[2].item() == pytest.approx(0.75 / 1.6)  # towards 0
    assert got[4].item() == pytest.approx(-2.25 * 1.6) and got[9].item() == pytest.approx(-3.0 * 1.6)  # away from 0
    assert got[6].item() == 0.0  # zero stays zero
    # A prompt token alone is penalised as much as an output token: the penalty covers both.
    assert got[4].item() / ROW[4] == pytest.approx(got[9].item() / ROW[9])


def test_presence_counts_a_repeated_token_once_and_frequency_every_time():
    prompt, output = [1], [3, 3, 3, 3, 5]  # token 3 four times, token 5 once; token 1 only in the prompt
    presence = process_logits(torch.tensor([ROW]), [seq(SamplingParams(presence_penalty=1.0), prompt, output)], ())
    frequency = process_logits(torch.tensor([ROW]), [seq(SamplingParams(frequency_penalty=1.0), prompt, output)], ())
    drop_p = [ROW[t] - presence[0, t].item() for t in (3, 5, 1)]
    drop_f = [ROW[t] - frequency[0, t].item() for t in (3, 5, 1)]
    assert drop_p == pytest.approx([1.0, 1.0, 0.0])  # once per distinct output token; prompt tokens are free
    assert drop_f == pytest.approx([4.0, 1.0, 0.0])  # once per occurrence


def test_each_row_gets_its_own_penalties_and_rows_that_ask_for_none_are_untouched():
    logits = torch.tensor([ROW, ROW[::-1], ROW])
    rows = [
        seq(SamplingParams(frequency_penalty=0.5), PROMPT, OUTPUT),
        seq(SamplingParams(), PROMPT, OUTPUT),
        seq(SamplingParams(repetition_penalty=1.5, presence_penalty=2.0), [0, 1], [2, 2]),
    ]
    got = process_logits(logits, rows, eos_token_ids=())
    assert torch.allclose(got[0], torch.tensor(reference_processed(ROW, rows[0].params, PROMPT, OUTPUT)))
    assert got[1].tolist() == ROW[::-1]
    assert torch.allclose(got[2], torch.tensor(reference_processed(ROW, rows[2].params, [0, 1], [2, 2])))
    assert process_logits(logits, [rows[1]] * 3, eos_token_ids=()) is logits  # nothing asked: no copy


def test_rows_processed_together_get_bit_for_bit_what_each_gets_alone():
    """The processors run across the rows that share a penalty's value: a row's logits come out exactly as when it
    is processed alone, and only its drawn tokens' change (a -0.0 elsewhere stays -0.0)."""
    vocab = 64
    logits = (torch.randn(8, vocab, generator=gen(4)) * 3).round()
    logits[:, ::5] = -0.0  # logits a zero penalty may turn into 0.0
    options = [
        dict(frequency_penalty=-0.5, presence_penalty=-0.25),
        dict(frequency_penalty=0.5, presence_penalty=-0.25),
        dict(frequency_penalty=-0.0, presence_penalty=-0.25),
        dict(frequency_penalty=0.0, presence_penalty=-0.25),
        dict(repetition_penalty=1.25, presence_penalty=0.5, logit_bias=((3, 1.5), (3, -0.25), (9, 2.0))),
        dict(repetition_penalty=1.25, min_tokens=4, stop_token_ids=(5, 6)),
        dict(repetition_penalty=0.8, frequency_penalty=0.5),
        dict(),
    ]
    rows = [
        seq(SamplingParams(**option), [(7 * i + j) % vocab for j in range(9)], [(3 * i + j * j) % 20 for j in range(i)])
        for i, option in enumerate(options)
    ]
    together = process_logits(logits, rows, eos_token_ids=(0,))
    for i, row in enumerate(rows):
        alone = process_logits(logits[i : i + 1], [row], eos_token_ids=(0,))[0]
        assert torch.equal(together[i].view(torch.int32), alone.view(torch.int32)), i
        changed = (
            set(row.prompt_token_ids) | set(row.output_token_ids) | {t for t, _ in row.params.logit_bias} | {0, 5, 6}
        )
        kept = [t for t in range(vocab) if t not in changed]
        assert torch.equal(together[i, kept].view(torch.int32), logits[i, kept].view(torch.int32)), i


# Probabilities whose ratios to the most likely one are 1, .8, .6, .4, .27, .17, .1: each min_p below keeps a
# different number of tokens, well clear of its threshold, and every token cut has mass enough to show if it leaked.
PROBS = [0.30, 0.24, 0.18, 0.12, 0.08, 0.05, 0.03]


def reference_min_p(probs: list[float], min_p: float) -> list[float]:
    """Keep the tokens with p >= min_p * p_max, renormalised."""
    kept = [p if p >= min_p * max(probs) else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


@pytest.mark.parametrize(
    "min_p,temperature,top_k,num_kept",
    [
        (0.7, 1.0, 0, 2),
        (0.5, 1.0, 0, 3),
        (0.35, 1.0, 0, 4),
        (0.2, 1.0, 0, 5),
        (0.3, 0.5, 0, 3),  # on the tempered probabilities (p squared): ratios 1, .64, .36, .16
        (0.2, 1.0, 3, 3),  # min_p keeps 5, top_k 3 of them
    ],
)
def test_min_p_keeps_the_tokens_within_min_p_of_the_most_likely(min_p, temperature, top_k, num_kept):
    draws = 2000
    tempered = [p ** (1 / temperature) for p in PROBS]
    want = reference_min_p([p / sum(tempered) for p in tempered], min_p)
    if top_k:
        cut = sorted(want, reverse=True)[top_k - 1]
        want = [p / sum(q for q in want if q >= cut) if p >= cut else 0.0 for p in want]
    assert sum(p > 0 for p in want) == num_kept
    # One row per draw, each with its own seed, beside greedy and unfiltered rows: per-row parameters.
    logits = torch.log(torch.tensor([PROBS] * (draws + 2)))
    params = [SamplingParams(min_p=min_p, temperature=temperature, top_k=top_k)] * draws
    params += [SamplingParams(temperature=0), SamplingParams(min_p=0.0)]
    tokens = sample(logits, params, [uniform(i, 0) for i in range(draws + 2)])
    counts = torch.bincount(torch.tensor(tokens[:draws]), minlength=len(PROBS)).float() / draws
    assert {t for t in tokens[:draws]} == {t for t, p in enumerate(want) if p > 0}
    assert torch.allclose(counts, torch.tensor(want), atol=0.04), (counts.tolist(), want)
    assert tokens[draws] == 0


def test_min_p_keeps_a_token_just_above_the_threshold_and_cuts_one_just_below():
    """p >= min_p * p_max: at min_p 0.5, a token at 0.50005 of the top one's probability stays, one at 0.49995
    goes (relative margins far above float32 rounding)."""
    logits = torch.log(torch.tensor([[1.0, 0.50005, 0.49995, 0.3]]))
    seen = {sample(logits, [SamplingParams(min_p=0.5)], [uniform(i, 0)])[0] for i in range(200)}
    assert seen == {0, 1}
