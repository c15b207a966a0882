"""`kvferry bench step` on a tiny model: decode steps at a full batch, split into the model and the rest."""

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.tools.bench.step import measure
from tests.tiny_models import save_tiny_model


def test_step_benchmark_times_full_decode_batches_and_leaves_the_engine_empty(tmp_path):
    save_tiny_model("llama", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, kv_cache_memory=2**20, max_num_seqs=8))
    model = engine.runner.model
    report = measure(engine, batch=6, context=20, steps=3)
    assert report["batch"] == 6 and report["steps"] == 3
    assert 0 < report["model_ms"] <= report["step_ms"]
    assert report["outside_model_ms"] >= 0 and 0 <= report["outside_share"] < 1
    assert engine.runner.model is model and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
