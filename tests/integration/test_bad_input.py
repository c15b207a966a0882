"""Bad input gets one clear error naming the value or limit, and never takes the engine down."""

import json
import math
import subprocess
import sys

import pytest
import torch

from kvferry.common.config import EngineConfig
from kvferry.common.engine import LLMEngine
from kvferry.common.engine_setup import resolve_kv_dtype
from kvferry.common.errors import ConfigError, InvalidRequest, ModelLoadError
from kvferry.common.model_files import resolve_model
from kvferry.common.sampling import SamplingParams
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory=2**20))


def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequest, match=r"256 tokens.*maximum of 255"):
        engine.add_request([5] * 256)
    with pytest.raises(InvalidRequest, match=r"token id 99999 .*vocabulary"):
        engine.add_request([5, 99999])
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add_request([5, 6], SamplingParams(temperature=math.nan))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.add_request([5, 6], SamplingParams(top_p=-1))
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    assert not engine.has_unfinished()
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out.output_token_ids) == 4


def test_a_bad_prompt_in_a_batch_queues_none_of_it(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate([[5, 6], []], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="2 prompts but 1 sampling"):
        engine.generate([[5, 6], [7]], [SamplingParams(max_tokens=2)])
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
        (dict(block_size=12), "block_size must be 8, 16 or 32"),
        (dict(kv_cache_memory=1000), "holds no block"),
        (dict(device="tpu"), "device 'tpu'"),
        (dict(device="cuda:7"), "CUDA devices"),
        (dict(num_threads=0), "num_threads must be at least 1"),
        (dict(max_model_len=1), "max_model_len must be at least 2"),
        (dict(max_model_len=10**6), "exceeds the model's limit 256"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be auto, float32, bfloat16 or float16"),
        (dict(memory_utilization=0), "memory_utilization must be more than 0 and at most 1"),
        (dict(memory_utilization=1.5), "memory_utilization must be more than 0 and at most 1"),
        (dict(memory_utilization=1e-9), "not enough memory for a KV cache"),
    ],
)
def test_bad_engine_settings_are_refused_by_name(tiny_dir, kwargs, expected):
    from kvferry.common.errors import KvferryError

    with pytest.raises(KvferryError) as err:
        LLMEngine(EngineConfig(model=str(tiny_dir), **kwargs))
    assert expected in str(err.value)


def test_loader_reads_only_the_transformers_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_tiny_model("mistral", tmp_path)
    # Mistral's own repos ship their native-format weights beside the transformers ones.
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(tmp_path / "consolidated.safetensors"))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_memory=2**20))
    [out] = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out.output_token_ids) == 2


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid config.json"):
        resolve_model(tmp_path)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found: .*nowhere"):
        resolve_model(tmp_path / "nowhere")


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as err:
        resolve_model(tmp_path)
    message = str(err.value)
    assert "'gpt2'" in message and all(a in message for a in ("llama", "mistral", "qwen2", "qwen3"))


def test_unsupported_gguf_fails_before_any_conversion(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        resolve_model(path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        resolve_model(junk)
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model", "/no/such/model"], "model path not found: /no/such/model"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "-2"], "max_tokens must be a positive integer"),
    ],
)
def test_cli_prints_one_line_errors_without_traceback(tiny_dir, args, expected):
    base = ["generate", "--prompt", "hi", "--model", str(tiny_dir)]
    result = run_cli(*base, *args)
    assert result.returncode == 2
    assert f"kvferry: error: {expected}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_kv_cache_larger_than_the_machine_fails_before_the_model_loads(tiny_dir):
    """Linux over-commits memory: without the check the cache would be granted, and the process killed later."""
    result = run_cli("generate", "--prompt", "hi", "--model", str(tiny_dir), "--kv-cache-memory", "100000GiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kvferry: error: not enough memory" in result.stderr
    assert "--kv-cache-memory asks 100000.00 GiB" in result.stderr and "lower --kv-cache-memory" in result.stderr
    assert "memory budget: weights" in result.stderr and "KV cache" in result.stderr
    assert "blocks x" not in result.stderr  # the engine never sized its cache: nothing was loaded


def test_serve_refuses_workers_that_cannot_fit_together_before_starting_any(tiny_dir):
    result = run_cli("serve", "--model", str(tiny_dir), "--kv-cache-memory", "100000GiB", "--port", "1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kvferry: error: not enough memory for serve's 2 workers" in result.stderr
    assert "--kv-cache-memory (KVFERRY_KV_CACHE_MEMORY)" in result.stderr
    assert "serving on" not in result.stdout


def test_a_kv_cache_sized_from_memory_is_logged_and_bounded_by_what_the_engine_can_fill(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), max_num_seqs=3, block_size=16))
    per_token = engine.bytes_per_block // 16
    assert engine.kv_cache_memory == 3 * (256 + 16) * per_token  # the tiny model's 256 tokens, 3 sequences
    assert engine.runner.kv_cache.dtype in (torch.float16, torch.bfloat16)  # the CPU's default: half precision


def test_a_kv_dtype_cuda_cannot_serve_is_refused_by_name():
    with pytest.raises(ConfigError) as refused:
        resolve_kv_dtype("float16", torch.device("cuda"), torch.bfloat16)
    assert "--kv-cache-dtype float16 is not served on CUDA beside --dtype bfloat16" in str(refused.value)
    assert resolve_kv_dtype("auto", torch.device("cuda"), torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.device("cpu"), torch.bfloat16) == torch.bfloat16  # a half model's own
    assert resolve_kv_dtype("float32", torch.device("cpu"), torch.float32) == torch.float32


def test_cli_bad_environment_value_is_a_usage_error(tiny_dir):
    import os

    result = subprocess.run(
        [sys.executable, "-m", "kvferry.tools.cli", "generate", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVFERRY_MAX_NUM_SEQS": "lots", "KVFERRY_MODEL": str(tiny_dir)},
    )
    assert result.returncode == 2
    assert "--max-num-seqs: invalid int value: 'lots'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_generate_with_the_default_model():
    ok = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "6", "--num-threads", "2")
    assert ok.returncode == 0, ok.stderr
    assert "Paris" in ok.stdout and "KV cache" in ok.stderr
    empty = run_cli("generate", "--prompt", "")
    assert empty.returncode == 2 and "the prompt is empty" in empty.stderr and "Traceback" not in empty.stderr
    too_long = run_cli("generate", "--prompt", "word " * 100, "--max-model-len", "64")
    assert too_long.returncode == 2 and "max_model_len 64" in too_long.stderr and "Traceback" not in too_long.stderr
