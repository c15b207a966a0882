"""Per-request sampling inside one batch: a seeded request gets the same tokens whatever shares its batch."""

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams, for_choice
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


def run(engine, prompt, params, resume_token_ids=()):
    """One request to its end, added as a moved request would be; its outputs, the resumed ones first."""
    request_id = engine.add_request(prompt, params, resume_token_ids=resume_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out.output_token_ids


def test_a_seeded_request_resumed_elsewhere_continues_its_stream(engine):
    """Stream 2 keys a seeded draw by (seed, output position): a request moved after k tokens (failover's
    resume_token_ids) draws the rest of the tokens it would have drawn uninterrupted."""
    prompt = [21, 22, 23, 24]
    [whole] = engine.generate([prompt], seeded(77, top_p=0.9))
    tokens = whole.output_token_ids
    assert len(set(tokens)) > 1  # it really sampled
    for k in (1, 5):
        assert run(engine, prompt, seeded(77, top_p=0.9), resume_token_ids=tokens[:k]) == tokens  # resumed + new


def test_choice_i_of_n_draws_what_a_single_request_with_seed_plus_i_draws(engine):
    prompt = [31, 32, 33]
    params = seeded(2**63 - 2)  # the choices' seeds wrap round
    request = engine.add_request(prompt, params)
    [out] = engine.step()
    extra = [for_choice(params, i) for i in range(1, 4)]
    firsts = [token for token, _, _ in engine.first_tokens(out, params, extra)]
    engine.abort(request)
    singles = [engine.generate([prompt], p)[0].output_token_ids for p in [params] + extra]
    assert firsts == [tokens[0] for tokens in singles] and len(set(map(tuple, singles))) == 4
    # A decode worker goes on from each choice's first token: the same tokens as the single request.
    for p, tokens in zip(extra, singles[1:]):
        assert run(engine, prompt, p, resume_token_ids=tokens[:1]) == tokens


def test_a_sampled_bench_workload_runs_sampled_in_process(engine):
    """`kvferry bench engine --workload std-32-t0.8-top-p0.95`: each request reaches the engine with its sampling."""
    from kvferry.tools.bench import workload
    from kvferry.tools.bench.offline import run_engine

    requests = [
        dict(r, prompt_token_ids=[t % engine.vocab_size for t in r["prompt_token_ids"][:6]], max_tokens=4)
        for r in workload.generate("std-32-t0.8-top-p0.95")[:3]
    ]
    received, add_request = [], engine.add_request
    engine.add_request = lambda prompt, params, **kw: received.append(params) or add_request(prompt, params, **kw)
    try:
        report = run_engine(engine, requests)
    finally:
        del engine.add_request
    assert report["output_tokens"] == 12
    assert [(p.temperature, p.top_p, p.seed, p.ignore_eos) for p in received] == [
        (0.8, 0.95, i, True) for i in range(3)
    ]
