"""Logprobs (generated and prompt) against transformers' log_softmax, and the logit processors' semantics."""

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.errors import InvalidRequest
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import VOCAB, save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_model("llama", folder)
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            kv_cache_memory=2**20,
            block_size=8,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            kv_cache_dtype="float32",  # logprobs compared with transformers' to 1e-4
        )
    )  # the 30-token prompt is prefilled in chunks
    return engine, hf


def test_generated_and_prompt_logprobs_match_log_softmax(tiny):
    engine, hf = tiny
    prompts = [list(range(3, 33)), [5, 9, 4]]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=20, prompt_logprobs=3)
    outs = engine.generate(prompts, params)
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            full = prompt + out.output_token_ids
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)  # [len, vocab]
            assert len(out.logprobs) == 5 and out.prompt_logprobs[0] is None
            for i, entry in enumerate(out.logprobs):
                row = ref[len(prompt) - 1 + i]
                assert entry.token_id == out.output_token_ids[i]
                assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
                assert len(entry.top_ids) == 20 and entry.top_ids[0] == entry.token_id  # greedy: the best one
                assert torch.allclose(torch.tensor(entry.top_logprobs), row.topk(20).values, atol=1e-4)
            assert len(out.prompt_logprobs) == len(prompt)
            for p in range(1, len(prompt)):
                entry = out.prompt_logprobs[p]
                assert entry.token_id == prompt[p]
                assert entry.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
                assert torch.allclose(torch.tensor(entry.top_logprobs), ref[p - 1].topk(3).values, atol=1e-4)


def test_no_logprobs_unless_asked(tiny):
    engine, _ = tiny
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert out.logprobs is None and out.prompt_logprobs is None


def greedy(**kw):
    return SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw})


def test_logit_bias_forces_and_bans_tokens(tiny):
    engine, _ = tiny
    [plain] = engine.generate([[5, 6, 7]], greedy())
    [forced] = engine.generate([[5, 6, 7]], greedy(logit_bias=((42, 100.0),)))
    assert forced.output_token_ids == [42] * 12
    banned = tuple((t, -100.0) for t in set(plain.output_token_ids))
    [avoided] = engine.generate([[5, 6, 7]], greedy(logit_bias=banned))
    assert not set(avoided.output_token_ids) & set(plain.output_token_ids)


def penalised(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The formula (vLLM's): repetition on prompt and output tokens (positive / penalty, negative * penalty), then
    frequency per output occurrence and presence per distinct output token."""
    row = row.clone()
    for token in set(prompt) | set(output):
        value = row[token].item()
        row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(output):
        row[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return row


@pytest.mark.parametrize(
    "kw", [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5}, {"repetition_penalty": 2.0}], ids=lambda kw: [*kw][0]
)
def test_penalised_greedy_tokens_are_the_argmax_of_the_reference_formula(tiny, kw):
    """Through the engine: each greedy token under a penalty is the argmax of transformers' logits with the formula
    applied to the tokens so far, and the penalty changed the output (greedy on random weights loops)."""
    engine, hf = tiny
    prompt = [9, 9, 9, 9]
    [plain] = engine.generate([prompt], greedy(max_tokens=24))
    assert len(set(plain.output_token_ids)) < 24
    [out] = engine.generate([prompt], greedy(max_tokens=24, **kw))
    assert out.output_token_ids != plain.output_token_ids
    params = SamplingParams(**kw)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.output_token_ids])).logits[0].float()  # [len, vocab]
    for i, token in enumerate(out.output_token_ids):
        row = penalised(logits[len(prompt) - 1 + i], params, prompt, out.output_token_ids[:i])
        assert row.max().item() - row[token].item() < 1e-4, (kw, i, token, row.argmax().item())


def test_min_tokens_masks_stop_tokens(tiny):
    engine, _ = tiny
    [plain] = engine.generate([[5, 6, 7]], greedy())
    stop = plain.output_token_ids[0]
    [early] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,)))
    assert early.output_token_ids == [stop] and early.finish_reason.name == "STOP"
    [held] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), min_tokens=4)
    )
    assert len(held.output_token_ids) >= 5 and stop not in held.output_token_ids[:4]


def test_min_p_one_is_greedy(tiny):
    engine, _ = tiny
    [plain] = engine.generate([[5, 6, 7]], greedy())
    [sampled] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, min_p=1.0, seed=3, ignore_eos=True)
    )
    assert sampled.output_token_ids == plain.output_token_ids


@pytest.mark.parametrize(
    "kw,field", [({"logit_bias": ((VOCAB + 5, 1.0),)}, "logit_bias"), ({"stop_token_ids": (VOCAB,)}, "stop_token_ids")]
)
def test_token_ids_outside_the_vocabulary_are_refused(tiny, kw, field):
    engine, _ = tiny
    with pytest.raises(InvalidRequest, match=field):
        engine.add_request([1, 2], SamplingParams(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 3},
        {"frequency_penalty": -2.5},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"min_tokens": 20, "max_tokens": 5},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"logit_bias": ((3, 101.0),)},
    ],
)
def test_bad_sampling_values_are_refused(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)
