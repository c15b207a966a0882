"""`kvferry bench random-model`: the folder it writes (the shape's config, weights of the asked type, the default
model's tokenizer and chat template), that kvferry serves it, and its refusals."""

import json
import subprocess
import sys

import pytest
from safetensors import safe_open

from kvferry.tools.bench.random_model import SHAPES


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", "bench", "random-model", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def parameters(shape: dict, vocab: int = 49152) -> int:
    """A tied-embedding Llama's parameter count from its shape."""
    hidden, head_dim = shape["hidden_size"], shape["head_dim"]
    attention = hidden * head_dim * (2 * shape["num_attention_heads"] + 2 * shape["num_key_value_heads"])
    layer = attention + 3 * hidden * shape["intermediate_size"] + 2 * hidden
    return vocab * hidden + shape["num_hidden_layers"] * layer + hidden


@pytest.mark.parametrize("shape, billions", [("smollm2-1.7b", 1.71), ("smollm2-360m", 0.362)])
def test_each_shape_has_its_models_size(shape, billions):
    assert parameters(SHAPES[shape]) / 1e9 == pytest.approx(billions, rel=0.01)


def test_the_folder_has_the_shape_the_weights_type_and_the_tokenizer(tmp_path):
    out = tmp_path / "model"
    result = run("--shape", "tiny", "--out", str(out), "--dtype", "float16", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert f"in {out}" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in SHAPES["tiny"]} == SHAPES["tiny"]
    assert config["vocab_size"] == 49152 and config["model_type"] == "llama"
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert weights.get_tensor(names[0]).dtype.itemsize == 2
    assert len(names) == 2 + 9 * SHAPES["tiny"]["num_hidden_layers"]  # embeddings and norm; 9 per layer
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()

    from kvferry.common.config import EngineConfig
    from kvferry.common.engine import LLMEngine
    from kvferry.common.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(out), num_threads=1))
    (output,) = engine.generate(["Hello"], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)])
    assert len(output.output_token_ids) == 3


def test_it_refuses_a_folder_that_is_not_empty_and_a_shape_it_does_not_know(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = run("--shape", "tiny", "--out", str(tmp_path))
    assert result.returncode == 2 and "not an empty folder" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    result = run("--shape", "llama-70b", "--out", str(tmp_path / "new"))
    assert result.returncode == 2 and "invalid choice" in result.stderr and not (tmp_path / "new").exists()
