"""The engine's one index of its sequences: what it keeps for a request between steps (its seeded generator, its
logprobs, its blocks when kept) lives on the request's Sequence, lasts through preemption, stays with a kept
sequence until release(), and goes with it."""

import dataclasses

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.errors import InvalidRequest
from kvferry.common.kv_connector import KVConnector
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model

ASKING = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=2, prompt_logprobs=1)
PROMPT = list(range(40, 61))


class Keeping(KVConnector):
    """Keeps finished sequences' blocks until release(), as a prefill worker's connector does."""

    keeps_finished_blocks = True


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder


def config(folder, kv_cache_memory=2**20):
    return EngineConfig(model=str(folder), kv_cache_memory=kv_cache_memory, block_size=8)


def run(engine, prompt, params, request_id=None):
    request_id = engine.add_request(prompt, params, request_id=request_id)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                done = out
    return done


def test_a_kept_request_keeps_its_id_and_state_until_released_and_leaves_nothing_behind(folder):
    engine = LLMEngine(config(folder), Keeping())
    out = run(engine, PROMPT, ASKING, "r")
    assert len(out.logprobs) == ASKING.max_tokens and out.prompt_logprobs[0] is None
    assert engine.prompt_logprobs_of("r") == out.prompt_logprobs and engine.kept_block_ids("r")
    assert engine.stats().num_free_blocks < engine.num_blocks
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request(PROMPT, ASKING, request_id="r")
    engine.release("r")
    assert engine.stats().num_free_blocks == engine.num_blocks and engine.prompt_logprobs_of("r") == []
    # The same id and seed again: a fresh generator, not the released one's drawn-down state, so the same tokens.
    again = run(engine, PROMPT, ASKING, "r")
    assert again.output_token_ids == out.output_token_ids
    assert [e.token_id for e in again.logprobs] == again.output_token_ids
    engine.release("r")


def test_a_preempted_request_keeps_its_generator_and_its_logprobs(folder):
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]  # 20 tokens each, 36 with their outputs: 5 blocks
    params = [dataclasses.replace(ASKING, seed=seed, max_tokens=16) for seed in range(4)]
    roomy = LLMEngine(config(folder))
    want = roomy.generate(prompts, params)
    small = LLMEngine(config(folder, kv_cache_memory=10 * roomy.bytes_per_block))  # 10 blocks for the 20 needed
    got = small.generate(prompts, params)
    assert small.scheduler.num_preemptions > 0
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids
        assert [e.token_id for e in g.logprobs] == g.output_token_ids
        assert [e.logprob for e in g.logprobs] == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(w.prompt_logprobs)
        assert [e.logprob for e in g.prompt_logprobs[1:]] == pytest.approx(
            [e.logprob for e in w.prompt_logprobs[1:]], abs=1e-4
        )
