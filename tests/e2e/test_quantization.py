"""--quantization int8 (and int4) across real processes: both workers quantize alike, so a completion through the stack equals the
in-process int8 engine's; a worker that computes otherwise is refused."""

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.sampling import SamplingParams
from kvferry.tools.bench.serve import served_quantization

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Write a haiku about rivers.", "def fibonacci(n):"]


def test_int8_stack_matches_the_in_process_int8_engine_and_refuses_an_unquantized_worker(make_stack):
    s = make_stack(extra_env={"KVFERRY_QUANTIZATION": "int8"})
    s.start_pair()  # the gateway too
    s.wait_workers({"prefill-a", "decode-a"})
    odd = s.start_worker("odd", "decode", "--quantization", "none")
    assert odd.wait(timeout=180) != 0
    assert "quantization mismatch" in s.log("odd") and "quantization mismatch" in s.log("gateway")
    assert {w["quantization"] for w in s.workers().values()} == {"int8"}
    assert served_quantization(s.url) == "int8"  # what `bench serve` takes its roofline's weights from

    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, quantization="int8", num_threads=1))
    params = SamplingParams(max_tokens=20, temperature=0)
    for prompt in PROMPTS:  # one at a time, alone in every step on both sides: the same arithmetic
        expected = engine.generate([prompt], params)[0].text
        status, reply = s.post("/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
        assert status == 200, reply
        assert reply["choices"][0]["text"] == expected, prompt


def test_int4_stack_matches_the_in_process_int4_engine(make_stack):
    s = make_stack(extra_env={"KVFERRY_QUANTIZATION": "int4"})
    s.start_pair()
    s.wait_workers({"prefill-a", "decode-a"})
    assert {w["quantization"] for w in s.workers().values()} == {"int4"}
    assert served_quantization(s.url) == "int4"
    engine = LLMEngine(EngineConfig(kv_cache_memory=64 * 2**20, quantization="int4", num_threads=1))
    params = SamplingParams(max_tokens=20, temperature=0)
    for prompt in PROMPTS:
        expected = engine.generate([prompt], params)[0].text
        status, reply = s.post("/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
        assert status == 200, reply
        assert reply["choices"][0]["text"] == expected, prompt
