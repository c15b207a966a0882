"""Per-request sampling inside one batch: a seeded request gets the same tokens whatever shares its batch."""

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_model("qwen3", folder)
    return LLMEngine(EngineConfig(model=str(folder), kv_cache_memory=2**20, block_size=8))


def seeded(seed, **kw):
    return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True, **kw)


def test_seed_reproduces_tokens_alone_and_in_a_crowd(engine):
    prompt = [11, 12, 13, 14, 15]
    [alone] = engine.generate([prompt], seeded(1234))
    crowd = engine.generate(
        [[40, 41], prompt, list(range(50, 90)), [7] * 9],
        [
            SamplingParams(max_tokens=5, temperature=0.9),
            seeded(1234),
            seeded(99, top_k=20),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        ],
    )
    assert crowd[1].output_token_ids == alone.output_token_ids
    [other_seed] = engine.generate([prompt], seeded(4321))
    assert other_seed.output_token_ids != alone.output_token_ids


def test_mixed_greedy_and_sampled_rows(engine):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    [alone] = engine.generate([[3, 4, 5]], greedy)
    mixed = engine.generate([[3, 4, 5], [3, 4, 5]], [greedy, seeded(5)])
    assert mixed[0].output_token_ids == alone.output_token_ids
    assert len(mixed[1].output_token_ids) == 12
