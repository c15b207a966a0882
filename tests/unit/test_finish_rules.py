"""The one finish rule of the scheduler and the synthetic workers (common/finish_rules.py): a stop token id ends a
sequence always, EOS unless ignore_eos, a complete constraint even with ignore_eos, and a token that both stops and
reaches the length stops; and the EOS ids both read from a model folder."""

import json
from types import SimpleNamespace

from kvferry.common.finish_rules import FinishRules
from kvferry.common.model_files import eos_token_ids
from kvferry.common.sampling import SamplingParams
from kvferry.common.sequence import FinishReason

EOS, STOP_ID, OTHER = 2, 7, 100
RULES = FinishRules((EOS,), max_model_len=64)


def test_stop_token_ids_end_a_sequence_even_with_ignore_eos_and_eos_does_not():
    params = SamplingParams(max_tokens=10, stop_token_ids=(STOP_ID,), ignore_eos=True)
    assert RULES.finish_reason(params, STOP_ID, 1, 5) == FinishReason.STOP
    assert RULES.finish_reason(params, EOS, 1, 5) is None
    assert RULES.finish_reason(SamplingParams(max_tokens=10), EOS, 1, 5) == FinishReason.STOP
    assert RULES.finish_reason(params, OTHER, 1, 5) is None


def test_stop_comes_before_length():
    params = SamplingParams(max_tokens=3, stop_token_ids=(STOP_ID,))
    assert RULES.finish_reason(params, STOP_ID, 3, 10) == FinishReason.STOP  # the last token allowed, and a stop
    assert RULES.finish_reason(params, OTHER, 3, 10) == FinishReason.LENGTH
    assert RULES.finish_reason(SamplingParams(max_tokens=100), OTHER, 5, 64) == FinishReason.LENGTH  # the model's
    assert RULES.finish_reason(SamplingParams(max_tokens=100), EOS, 5, 64) == FinishReason.STOP


def test_a_complete_constraint_stops_even_with_ignore_eos():
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert RULES.finish_reason(params, OTHER, 1, 5, SimpleNamespace(terminated=True)) == FinishReason.STOP
    assert RULES.finish_reason(params, OTHER, 1, 5, SimpleNamespace(terminated=False)) is None


def test_eos_ids_come_from_generation_config_first_then_config_whatever_reads_it(tmp_path):
    """model_files.eos_token_ids: the engine passes transformers' config object, the synthetic workers the dict
    read_config makes of config.json; both read the same ids."""
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == (2,)
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=[2, 3])) == (2, 3)
    assert eos_token_ids(tmp_path, {}) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos_token_ids(tmp_path, {"eos_token_id": 2}) == eos_token_ids(tmp_path, SimpleNamespace()) == (5, 6)
