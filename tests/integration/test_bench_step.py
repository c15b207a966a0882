"""`kvferry bench step` on a tiny model: decode steps at a full batch, split into the model and the rest."""

import json
import time

import pytest

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.tools.bench.step import measure
from kvferry.tools.cli import main
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


def test_step_command_runs_the_measure_asked_for_and_refuses_another_measures_options(tmp_path, capsys):
    """`bench step --measure ...` is one command over split, breakdown, paging and roofline: each measure reports
    its own figures with the sizes given, and an option of another measure is refused rather than ignored."""
    save_tiny_model("llama", tmp_path)
    engine = ["--model", str(tmp_path), "--block-size", "8", "--kv-cache-memory", "1MiB", "--max-num-seqs", "8"]
    small = ["--batch", "4", "--context", "16", "--steps", "2"]
    assert main(["bench", "step", *small, *engine, "--json"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert split["measure"] == "split" and (split["batch"], split["context"], split["steps"]) == (4, 16, 2)
    assert 0 < split["model_ms"] <= split["step_ms"], split
    assert main(["bench", "step", "--measure", "paging", *small, *engine, "--json"]) == 0
    paging = json.loads(capsys.readouterr().out)
    assert paging["measure"] == "paging" and (paging["batch"], paging["context"]) == (4, 16), paging
    assert paging["overhead"] > 0 and paging["overhead_vs_preallocated"] > 0, paging  # ratios of unrounded times
    assert main(["bench", "step", "--measure", "paging", *small, *engine]) == 0
    assert "paging overhead" in capsys.readouterr().out
    for name, option in (("paging", "--chunk"), ("split", "--trials"), ("roofline", "--batch")):
        assert main(["bench", "step", "--measure", name, option, "3", *engine]) == 2
        assert f"{option} does not apply to --measure {name}" in capsys.readouterr().err
    # The earlier names are the command with their measure: `bench roofline` takes no --batch, and names its own.
    assert main(["bench", "roofline", "--batch", "3", *engine]) == 2
    assert "--batch does not apply to --measure roofline" in capsys.readouterr().err
    assert main(["bench", "breakdown", "--measure", "paging", *engine]) == 2
    assert "bench breakdown is bench step --measure breakdown" in capsys.readouterr().err


def test_loop_measure_runs_a_real_decode_worker_whose_every_step_reaches_its_gateway(tmp_path, capsys):
    """`--measure loop`: a DecodeWorker's own loop decodes the batch, a forward pass per step, and every
    sequence's token of every step arrives at the bench's gateway as a Tokens message; the worker is left empty."""
    from kvferry.tools.bench import loop

    save_tiny_model("llama", tmp_path)
    engine = ["--model", str(tmp_path), "--block-size", "8", "--kv-cache-memory", "1MiB", "--num-threads", "1"]
    options = [
        "--measure",
        "loop",
        "--batch",
        "1,5",
        "--context",
        "12",
        "--steps",
        "3",
        "--sampling",
        "greedy,penalized",
    ]
    assert main(["bench", "step", *options, *engine, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    runs = report["runs"]
    assert [(r["sampling"], r["batch"]) for r in runs] == [
        ("greedy", 1),
        ("greedy", 5),
        ("penalized", 1),
        ("penalized", 5),
    ]
    for r in runs:
        # As a gateway that takes TokenBatch: one message a step, each sequence's Tokens in it.
        assert r["tokens_messages"] == loop.WARMUP_STEPS + 3 + 1, r
        assert r["sequence_tokens"] == r["batch"] * (loop.WARMUP_STEPS + 3 + 1), r
        assert 0 < r["forward_ms"] <= r["step_ms"] and r["outside_ms"] >= 0 and r["process_cpu_ms_per_step"] > 0, r
        assert 0 < r["messages_cpu_ms"] <= r["outside_cpu_ms"], r  # each step's Tokens are part of the loop's time
    assert main(["bench", "step", *options, "--sampling", "greedy,beam", *engine]) == 2
    assert "--sampling takes greedy" in capsys.readouterr().err
    assert main(["bench", "step", "--measure", "split", "--batch", "1,5", *engine]) == 2
    assert "takes one --batch" in capsys.readouterr().err
