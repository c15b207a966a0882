"""Constrained decoding in the engine, on a tiny random model with the default model's tokenizer: a random model
goes wherever the mask lets it, so every output matching its constraint is the constraint's doing. Also what must
not change: unconstrained rows beside constrained ones, and the constraint through choices, preemption, chunked
prefill with prefix caching, and a resume."""

import json
import re

import jsonschema
import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.constraint import Constraint
from kvferry.common.engine import LLMEngine
from kvferry.common.errors import InvalidRequest
from kvferry.common.sampling import SamplingParams, for_choice
from kvferry.common.sequence import FinishReason
from tests.tiny_models import save_tiny_chat_model

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
        "tame": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["kind", "legs", "tame", "tags"],
}
JSON = Constraint("json", json.dumps(SCHEMA, separators=(",", ":")), "response_format.json_schema.schema")
WORD = r"[a-z]{2,6}(-[0-9]{1,3})?"
REGEX = Constraint("regex", WORD, "structured_outputs.regex")
PROMPT = [1, 504, 3300, 28, 253, 1359, 30]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_chat_model(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(folder):
    return LLMEngine(EngineConfig(model=folder, kv_cache_memory=2**21, block_size=8, num_threads=1))


def valid(engine, out, constraint: Constraint) -> bool:
    text = engine.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    jsonschema.validate(json.loads(text), json.loads(constraint.spec))
    return True


def params(constraint=None, **kw):
    return SamplingParams(**{"max_tokens": 60, "temperature": 1.0, "constraint": constraint, **kw})


def test_sampled_and_greedy_outputs_match_their_constraint(engine):
    outs = engine.generate(
        [PROMPT] * 6, [params(JSON, seed=s) for s in range(3)] + [params(REGEX, seed=s, top_k=40) for s in range(2)]
        + [params(JSON, temperature=0)],
    )  # fmt: skip
    for out, constraint in zip(outs, [JSON] * 3 + [REGEX] * 2 + [JSON]):
        assert out.finish_reason == FinishReason.STOP and valid(engine, out, constraint)


def test_unconstrained_rows_are_the_same_beside_constrained_ones(engine):
    free = [params(seed=7, ignore_eos=True, max_tokens=20), params(temperature=0, ignore_eos=True, max_tokens=20)]
    alone = engine.generate([PROMPT, PROMPT[:4]], free)
    mixed = engine.generate([PROMPT, PROMPT, PROMPT[:4], PROMPT], [free[0], params(JSON), free[1], params(REGEX)])
    assert [mixed[0].output_token_ids, mixed[2].output_token_ids] == [o.output_token_ids for o in alone]
    assert valid(engine, mixed[1], JSON) and valid(engine, mixed[3], REGEX)


def test_each_choice_draws_its_first_token_under_its_own_matcher(engine):
    request = engine.add_request(PROMPT, params(REGEX, seed=3, max_tokens=2))
    [out] = engine.step()
    extra = [for_choice(params(REGEX, seed=3), i) for i in range(1, 6)]
    firsts = engine.first_tokens(out, params(REGEX, seed=3), extra)
    assert len(firsts) == 6 and len({t for t, _, _ in firsts}) > 1  # their own seeds
    for token_id, _, reason in firsts:
        assert reason is None and re.fullmatch(r"[a-z]+", engine.tokenizer.decode([token_id]))  # a start of WORD
    engine.abort(request)


def test_a_dead_end_finishes_with_its_reason_and_no_token(engine):
    # The grammar is complete after "no"; min_tokens masks the EOS it then needs: nothing is left.
    choice = Constraint("choice", '["no"]', "structured_outputs.choice")
    [out] = engine.generate([PROMPT], [params(choice, min_tokens=5, temperature=0)])
    assert out.finish_reason == FinishReason.DEAD_END
    assert engine.tokenizer.decode(out.output_token_ids) == "no"


def test_a_resumed_request_continues_under_its_constraint(engine):
    greedy = params(JSON, temperature=0)
    [whole] = engine.generate([PROMPT], [greedy])
    done = whole.output_token_ids[:5]
    engine.add_request(PROMPT, greedy, request_id="moved", resume_token_ids=done)
    while engine.has_unfinished():
        outs = [o for o in engine.step() if o.finished]
    assert outs[0].output_token_ids == whole.output_token_ids  # the move changes nothing for a greedy request
    with pytest.raises(InvalidRequest, match="breaks its constraint"):
        engine.add_request(PROMPT, greedy, resume_token_ids=engine.tokenizer.encode("[1, 2]"))


def test_preemption_chunked_prefill_and_prefix_caching_keep_the_constraint(folder):
    # 12 blocks of 8 tokens: the batch outgrows them and is preempted; a long shared prompt is chunked and cached.
    small = LLMEngine(
        EngineConfig(
            model=folder, kv_cache_memory=12 * 8 * 2 * 2 * 2 * 16 * 4, block_size=8, max_num_batched_tokens=16,
            long_prefill_threshold=16, max_num_seqs=4, num_threads=1,
        )
    )  # fmt: skip
    long_prompt = PROMPT * 6
    outs = small.generate([long_prompt] * 2 + [PROMPT] * 3, [params(JSON, seed=s) for s in range(5)])
    assert small.scheduler.num_preemptions > 0 and small.scheduler.num_cached_prompt_tokens > 0
    for out in outs:
        assert out.finish_reason == FinishReason.STOP and valid(small, out, JSON)


def test_max_tokens_ends_with_length_on_a_prefix_the_grammar_accepts(engine):
    [out] = engine.generate([PROMPT], [params(JSON, max_tokens=6)])
    assert out.finish_reason == FinishReason.LENGTH and len(out.output_token_ids) == 6
    engine.constraint_state(params(JSON), out.output_token_ids)  # raises if the grammar refuses any of them


def test_logprobs_are_the_unconstrained_models(engine):
    # The first token's top alternatives, constrained or not, are the model's: the mask changes only the draw.
    [free] = engine.generate([PROMPT], [params(temperature=0, max_tokens=1, logprobs=5)])
    [held] = engine.generate([PROMPT], [params(REGEX, temperature=0, max_tokens=1, logprobs=5)])
    assert held.logprobs[0].top_ids == free.logprobs[0].top_ids
    assert held.logprobs[0].top_logprobs == pytest.approx(free.logprobs[0].top_logprobs)
    allowed = held.output_token_ids[0]
    assert re.fullmatch(r"[a-z]+", engine.tokenizer.decode([allowed]))


def test_the_grammar_a_worker_compiled_is_used_not_compiled_again(engine):
    from kvferry.common.structured.grammars import GrammarCache

    xyz = Constraint("regex", "[xyz]{4}", "structured_outputs.regex")
    compiled = GrammarCache(lambda: engine.tokenizer, engine.vocab_size, (2,)).compile(xyz)  # as a compile thread does
    num_compiles = engine.grammars.num_compiles
    engine.add_request(PROMPT, params(xyz), request_id="pinned", grammar=compiled)
    while engine.has_unfinished():
        done = [o for o in engine.step() if o.finished]
    assert engine.grammars.num_compiles == num_compiles and engine.grammars.cached(xyz, count=False) is None
    assert re.fullmatch("[xyz]{4}", engine.tokenizer.decode(done[0].output_token_ids, skip_special_tokens=True))
