"""`kvferry bench step` on a tiny model: decode steps at a full batch, split into the model and the rest."""

import time

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.tools.bench.step import measure
from tests.tiny_models import save_tiny_model

FORWARD_S = 0.02  # each forward made to take at least this long


class SlowModel:
    """The model, each forward at least FORWARD_S long (time.sleep never returns early): the model's share of a step
    has a known floor wherever the forward runs."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args):
        time.sleep(FORWARD_S)
        return self.model(*args)

    def __getattr__(self, name):  # compute_logits, and what the decode graphs read (the embedding's dtype)
        return getattr(self.model, name)


@pytest.mark.parametrize("path", ["eager", "decode graphs"])
def test_step_benchmark_counts_the_forward_as_the_model_and_leaves_the_engine_empty(tmp_path, path):
    """The decode graphs run uncaptured here (the CPU's stand-in for a replay): their run is the model's share, as a
    replay is on CUDA, where bench step reads CUDA events instead of the host's clock."""
    save_tiny_model("llama", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, kv_cache_memory=2**20, max_num_seqs=8))
    runner = engine.runner
    runner.model = SlowModel(runner.model)
    if path == "decode graphs":
        runner.use_decode_graphs(8, -(-engine.max_model_len // 8), capture=False)
        graphs = runner.decode_graphs
    model = runner.model
    report = measure(engine, batch=6, context=20, steps=3)
    assert report["batch"] == 6 and report["steps"] == 3
    assert FORWARD_S * 1000 <= report["model_ms"] <= report["step_ms"], report
    assert report["outside_model_ms"] >= 0 and 0 <= report["outside_share"] < 1  # medians of step minus model
    assert runner.model is model and not engine.has_unfinished()
    if path == "decode graphs":
        assert runner.decode_graphs is graphs and "run" not in vars(graphs)  # its own method again
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
