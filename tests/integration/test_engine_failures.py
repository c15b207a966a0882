"""A step that raises belongs to no single request: the engine ends that step's requests with an error output,
frees their blocks (kept ones too), and goes on serving the others as if nothing happened."""

import pytest

from kvferry.common import received_kv
from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.kv_connector import KVConnector
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[11, 12, 13, 14, 15], list(range(40, 61))]


class RaisingConnector(KVConnector):
    """Raises from inside the forward pass (the layer hook) on the steps named; keeps finished blocks, as a prefill
    worker's connector does."""

    keeps_finished_blocks = True
    wants_layer_events = True

    def __init__(self, failing_steps):
        self.failing_steps = set(failing_steps)

    def save_layers(self, plan, layers):
        if self.engine.num_steps in self.failing_steps:
            raise RuntimeError("a hook failed")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder


def config(folder):
    return EngineConfig(model=str(folder), kv_cache_memory=2**20, block_size=8)


def run(engine, prompts, params):
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def test_a_failing_step_ends_its_requests_alone_and_the_engine_serves_on(folder, monkeypatch):
    reference = LLMEngine(config(folder)).generate(PROMPTS, GREEDY)
    monkeypatch.setenv("KVFERRY_FAULTS", "fail_step=3")  # a decode step, both requests in it
    engine = LLMEngine(config(folder))
    failed = run(engine, PROMPTS, GREEDY)
    assert all(out.error and "step 3 fails" in out.error and out.finish_reason.name == "ABORT" for out in failed)
    assert [len(out.output_token_ids) for out in failed] == [2, 2]  # the prefill's token and one decode step's
    assert engine.stats().num_free_blocks == engine.num_blocks and not engine.has_unfinished()
    again = run(engine, PROMPTS, GREEDY)
    assert [out.output_token_ids for out in again] == [out.output_token_ids for out in reference]


def test_a_hook_failing_inside_the_forward_frees_even_kept_blocks(folder):
    engine = LLMEngine(config(folder), RaisingConnector(failing_steps={1}))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # finishes in its prefill step
    [failed] = run(engine, PROMPTS[:1], params)
    assert "a hook failed" in failed.error
    assert engine.stats().num_free_blocks == engine.num_blocks
    [served] = run(engine, PROMPTS[:1], params)  # step 2: served, its blocks kept until released
    assert not served.error and engine.stats().num_free_blocks < engine.num_blocks
    engine.release(served.request_id)
    assert engine.stats().num_free_blocks == engine.num_blocks


def test_admitting_received_kv_is_all_or_nothing(folder, monkeypatch):
    """The second choice's copy of the shared partial block fails: no choice is admitted, and the blocks stay the
    caller's to free, as after a refusal (a decode worker's transfer refused with a 500)."""
    engine = LLMEngine(config(folder))
    prompt = list(range(40, 61))  # 21 tokens: 2 full blocks of 8 and a partial one
    layers = (0, engine.num_layers)
    kv_blocks = received_kv.reserve(engine, ["c0", "c1"], prompt, [GREEDY, GREEDY])
    engine.connector.load_blocks(kv_blocks, engine.read_kv(kv_blocks, layers), 0)
    monkeypatch.setattr(engine.runner, "copy_block", lambda src, dst: (_ for _ in ()).throw(RuntimeError("copy")))
    with pytest.raises(RuntimeError, match="copy"):
        engine.admit_prefilled(["c0", "c1"], prompt, [5, 6], [GREEDY, GREEDY], kv_blocks)
    assert not engine.has_unfinished()
    engine.free_blocks(kv_blocks)
    assert engine.stats().num_free_blocks == engine.num_blocks
    monkeypatch.undo()  # and the same transfer admits whole afterwards
    kv_blocks = received_kv.reserve(engine, ["c0", "c1"], prompt, [GREEDY, GREEDY])
    assert engine.admit_prefilled(["c0", "c1"], prompt, [5, 6], [GREEDY, GREEDY], kv_blocks)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_free_blocks == engine.num_blocks
