"""What the runner does differently on CUDA, run on the CPU as far as the CPU allows: the step's inputs packed into
one buffer (one copy to the device), and a decode-graph capture that fails, after which the engine runs eager."""

import logging

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.engine_setup import capture_decode_graphs
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model

PROMPTS = [[11, 12, 13, 14, 15], list(range(40, 61)), [7] * 9, [3, 4]]


def params():
    return [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.2, top_p=0.7, min_p=0.05, seed=6, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder


def config(folder):
    return EngineConfig(
        model=str(folder), kv_cache_memory=2**20, block_size=8, max_num_batched_tokens=16, max_num_seqs=4
    )


def outputs(engine):
    return [(out.output_token_ids, out.prompt_logprobs, out.logprobs) for out in engine.generate(PROMPTS, params())]


def test_packed_step_inputs_give_the_same_outputs(folder):
    reference = outputs(LLMEngine(config(folder)))
    engine = LLMEngine(config(folder))
    engine.runner.pack_inputs = True  # CUDA's layout: every input a view of one buffer
    assert outputs(engine) == reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="the capture fails here for want of CUDA, as a bad kernel would")
def test_a_failed_graph_capture_leaves_decode_eager_with_the_same_tokens(folder, caplog):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = [out.output_token_ids for out in LLMEngine(config(folder)).generate(PROMPTS, greedy)]
    engine = LLMEngine(config(folder))
    # The real capture routine, which fails here as a kernel that does not compile would: no CUDA to capture on.
    with caplog.at_level(logging.WARNING, logger="kvferry.engine"):
        capture_decode_graphs(engine.runner, engine.config, engine.max_model_len)
    assert engine.runner.decode_graphs is None
    [warning] = [r.getMessage() for r in caplog.records if "graphs failed" in r.getMessage()]
    assert "decode steps run eager" in warning and "RuntimeError" in warning
    assert [out.output_token_ids for out in engine.generate(PROMPTS, greedy)] == reference


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs, pinned memory and streams need CUDA")
def test_on_cuda_the_captured_graphs_give_the_eager_tokens_in_fp32(folder):
    # At most 256 tokens: a graph's block table is as wide as the longest allowed context, and past 512 tokens the
    # decode kernel would split it (another summation order than eager's table, sized to the batch, gets).
    settings = dict(
        model=str(folder), kv_cache_memory=2**20, block_size=8, max_num_seqs=4, max_model_len=256, dtype="float32"
    )
    eager = LLMEngine(EngineConfig(**settings, device="cuda:0", enforce_eager=True))
    graphs = LLMEngine(EngineConfig(**settings, device="cuda:0"))
    assert torch.cuda.current_device() == 0
    assert graphs.runner.decode_graphs is not None and graphs.runner.decode_graphs.capture
    tokens = [[out.output_token_ids for out in engine.generate(PROMPTS, params())] for engine in (eager, graphs)]
    assert tokens[0] == tokens[1]
