"""`kvferry bench breakdown` on a tiny model: every part of a decode and a prefill step, adding up to the step."""

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.tools.bench.breakdown import PARTS, REST, WRAPPERS, measure
from tests.tiny_models import save_tiny_model


def test_breakdown_parts_are_non_negative_and_add_up_to_the_step(tmp_path):
    save_tiny_model("llama", tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=8, kv_cache_memory=2**20, max_num_seqs=8))
    model = engine.runner.model
    report = measure(engine, batch=4, context=16, chunk=48, steps=2, warmup=1, gemm_budget_s=0.001, read_bytes=2**20)
    for kind, tokens in (("decode", 4), ("prefill", 48)):
        r = report[kind]
        assert r["tokens"] == tokens and r["steps"] == 2, r
        rows = {row["part"]: row for row in r["parts"]}
        assert list(rows) == [*PARTS, WRAPPERS, REST], r
        assert all(row["ms"] >= 0 for row in rows.values()), r
        assert abs(sum(row["ms"] for row in rows.values()) - r["step_ms"]) < 0.001 * len(rows), r
        glue = ("attention's views", "decoder layers' glue")  # Python around the ops: no roofline of their own
        assert all(rows[p]["roofline_ms"] >= 0 for p in PARTS if p not in glue), r
        assert all(rows[p]["roofline_ms"] is None for p in glue), r
    assert report["read_gb_per_s"] > 0 and report["gemm_gflops"]
    # Nothing stays wrapped, and the engine is left empty.
    assert "forward" not in vars(model.layers[0].mlp) and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
